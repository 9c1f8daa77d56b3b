"""fp_dcp demo: save, async-save and reshard-load a generated model, beside the
stock FileSystemWriter / FileSystemReader.

    python tools/demo.py [--size 1GiB] [--ranks 2] [--dir DIR]

1. ``--ranks`` gloo processes each hold a Shard(0) slice of every parameter
   (DTensor) and save the model with ``dcp.save``: fp_dcp, then stock.
2. The same processes ``dcp.async_save`` with fp_dcp twice: the time until
   training could go on, and until the checkpoint is committed.  The first
   async save also allocates the page-locked staging memory (first touch of
   every page: seconds per GiB on a VM); a training loop pays that once, so
   the second one is what each later checkpoint costs.
3. One process without a process group loads the sharded checkpoint into
   whole tensors (a resharded restart) with each reader, and checks every
   tensor bit for bit against the model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp_dcp.options import parse_size  # noqa: E402


def make_model(total_bytes: int):
    """A transformer-shaped stack of float32 / bfloat16 parameters, seeded."""
    import torch

    g = torch.Generator().manual_seed(1234)
    hidden = 2048
    sd = {"embed.weight": torch.randn(8192, hidden, generator=g)}
    layer = 0
    while sum(t.numel() * t.element_size() for t in sd.values()) < total_bytes:
        p = f"layers.{layer}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        sd[p + "attn.out.weight"] = torch.randn(hidden, hidden, generator=g).to(torch.bfloat16)
        sd[p + "mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        sd[p + "mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=g).to(torch.bfloat16)
        sd[p + "norm.weight"] = torch.ones(hidden)
        layer += 1
    return sd


def _rank_main(rank: int, world: int, init_file: str, size: int, root: str, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistWriter

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_model(size).items()}
    sd = {"model": model, "step": 100}
    out = {}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    writer = FastPersistWriter()
    out["fp_dcp save"] = timed(lambda: dcp.save(sd, storage_writer=writer, checkpoint_id=os.path.join(root, "fp")))
    out["engine"] = writer.last_stats.get("engine")
    out["stock save"] = timed(
        lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(root, "stock")))
    )

    returned = {}

    def async_round(name):
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, storage_writer=writer, checkpoint_id=os.path.join(root, name))
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        returned["return"] = time.perf_counter() - t0
        if staging is not None:
            staging.result()
        returned["staged"] = time.perf_counter() - t0
        upload.result()

    for which in ("first", "steady"):
        out[f"async {which} total"] = timed(lambda: async_round(f"fp_async_{which}"))
        out[f"async {which} returned"] = returned["return"]
        out[f"async {which} staged"] = returned["staged"]
    writer.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="model bytes (default 1GiB)")
    ap.add_argument("--ranks", type=int, default=2, help="processes saving the sharded model (default 2)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /work or /tmp)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)

    import multiprocessing as mp
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    warnings.simplefilter("ignore")
    base = args.dir or ("/work" if os.access("/work", os.W_OK) else None)
    root = tempfile.mkdtemp(prefix="fp_dcp_demo_", dir=base)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        init_file = os.path.join(root, "rendezvous")
        procs = [
            ctx.Process(target=_rank_main, args=(r, args.ranks, init_file, size, root, queue))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        out = queue.get(timeout=1800)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a saving rank failed (exit code {p.exitcode})")

        model = make_model(size)
        nbytes = sum(t.numel() * t.element_size() for t in model.values())
        print(f"model: {len(model)} tensors, {nbytes / 2**30:.2f} GiB, saved by {args.ranks} ranks as Shard(0) DTensors")
        print(f"engine: {out['engine']}\n")
        rows = [
            ("dcp.save, fp_dcp", out["fp_dcp save"]),
            ("dcp.save, stock FileSystemWriter", out["stock save"]),
            ("dcp.async_save, fp_dcp, steady (until committed)", out["async steady total"]),
            ("dcp.async_save, fp_dcp, first (until committed)", out["async first total"]),
        ]
        for name, sec in rows:
            print(f"  {name:<50} {sec:7.2f} s  {nbytes / sec / 1e9:6.2f} GB/s")
        for which in ("steady", "first"):
            print(f"  dcp.async_save, {which:<6} returned after {out[f'async {which} returned'] * 1e3:7.1f} ms; "
                  f"training may step again after {out[f'async {which} staged'] * 1e3:7.1f} ms")
        print(f"  fp_dcp save is {out['stock save'] / out['fp_dcp save']:.1f}x the stock writer\n")

        # Resharded restart: 2 ranks' Shard(0) slices -> whole tensors in one process.
        stock_dir = os.path.join(root, "stock")
        for name, reader in [
            ("fp_dcp", FastPersistReader(os.path.join(root, "fp"))),
            ("stock", dcp.FileSystemReader(stock_dir)),
        ]:
            target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "step": 0}
            if os.geteuid() == 0:
                os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=reader)
            sec = time.perf_counter() - t0
            ok = target["step"] == 100 and all(torch.equal(target["model"][k], v) for k, v in model.items())
            print(f"  reshard-load {args.ranks}->1, {name:<7} {sec:7.2f} s  {nbytes / sec / 1e9:6.2f} GB/s  "
                  f"{'bit-exact' if ok else 'MISMATCH'}")
            if not ok:
                return 1
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
