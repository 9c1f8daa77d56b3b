"""Planning time of a DCP save through FastPersistWriter, save 1 vs save 2,
with and without DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``).

    PYTHONPATH=. python tools/plan_caching_time.py --ranks 2 --tensors 9245 --saves 3

Planning = from the call of ``dcp.save`` to the moment ``write_data`` starts
on the coordinator (DCP's local and global planning, fp_dcp's
``prepare_local_plan`` / ``prepare_global_plan``, the gather and the
scatter); ``ours`` = fp_dcp's two steps alone (coordinator).  Gloo on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank, world_size, root, n_tensors, saves, caching):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fp_dcp import FastPersistWriter

    class Timed(FastPersistWriter):
        def prepare_local_plan(self, plan):
            t = time.perf_counter()
            try:
                return super().prepare_local_plan(plan)
            finally:
                self.t_ours += time.perf_counter() - t

        def prepare_global_plan(self, plans):
            t = time.perf_counter()
            try:
                return super().prepare_global_plan(plans)
            finally:
                self.t_ours += time.perf_counter() - t

        def write_data(self, plan, planner):
            self.t_write = time.perf_counter()
            return super().write_data(plan, planner)

    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i // 8}.p{i % 8}": torch.randn(256, generator=g) for i in range(n_tensors)}
    sd["shared_embed"] = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1))
    out = []
    for s in range(saves):
        w = Timed(os.path.join(root, f"s{s}"))
        w.t_ours = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=w, planner=DefaultSavePlanner(enable_plan_caching=caching))
        t1 = time.perf_counter()
        out.append({
            "planning_s": w.t_write - t0,
            "ours_s": w.t_ours,
            "save_s": t1 - t0,
            "dcp_cached": w.last_plan.get("dcp_cached"),
        })
        w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=9245)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from tests._dist import run_ranks

    results = {}
    for caching in (False, True):
        with tempfile.TemporaryDirectory() as d:
            res = run_ranks(args.ranks, _rank, d, args.tensors, args.saves, caching, timeout=900)
        results["caching" if caching else "no_caching"] = res[0]
        for i, r in enumerate(res[0]):
            print(
                f"caching={caching!s:5} save {i + 1}: planning {r['planning_s'] * 1e3:8.1f} ms "
                f"(fp_dcp's part {r['ours_s'] * 1e3:7.1f} ms), whole save {r['save_s'] * 1e3:8.1f} ms, "
                f"dcp_cached={r['dcp_cached']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
