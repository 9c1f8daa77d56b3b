"""Planning time of DCP saves and loads through fp_dcp, with DCP's default
planners and with fp_dcp's (``FastPersistSavePlanner`` /
``FastPersistLoadPlanner``), with and without DCP's plan caching; and the
coordinator's global planning of a save at simulated scale.

    PYTHONPATH=. python tools/plan_caching_time.py --ranks 1,2,4 --tensors 9245 --saves 3
    PYTHONPATH=. python tools/plan_caching_time.py --ranks 0 --simulate 64x1000,1024x2000
    PYTHONPATH=. python tools/plan_caching_time.py --ranks 0 --simulate 1024x2000 --planners fp --restart
    PYTHONPATH=. python tools/plan_caching_time.py --ranks 4 --saves 3 --caching off --phases

Real ranks (gloo on the CPU; every rank holds the same ``--tensors`` small
tensors, DDP style, so the coordinator deduplicates them):

* save planning = from the call of ``dcp.save`` to the moment ``write_data``
  starts on the coordinator (DCP's local and global planning, fp_dcp's
  ``prepare_local_plan`` / ``prepare_global_plan``, the gather and the
  scatter); ``ours`` = fp_dcp's storage steps alone;
* load planning = from the call of ``dcp.load`` to the moment ``read_data``
  starts on the coordinator (metadata read, planning, gather, scatter);
* ``plan_bytes``: the pickled local plan rank 0 sends to the coordinator;
* ``--phases``: the coordinator's time in each planning step (set-up, local
  plan, the storage's hooks, global plan) and between them (DCP's own code
  and its gather / scatter), for the save and for the load.

Simulated (one process, ``RANKSxITEMS``): every rank holds ITEMS tensors
sharded along dim 0 across all ranks (FSDP style) and one replicated
object; the coordinator's whole share is timed: unpickling every rank's
local plan (the gather), ``create_global_plan`` (dedup, global plan,
Metadata, validation), ``FastPersistWriter.prepare_global_plan`` (the
storage's placement, from what each rank's ``prepare_local_plan`` added
to its plan; ``--storage off``: left out, and out of the messages) and
pickling every rank's global plan (the scatter).  ``--restart`` then
times that save's commit (every rank's write results gathered, the layout,
the metadata file's bytes) and its metadata's decoding, which every rank of
a restart does (``read_metadata``), beside DCP's ``FileSystemWriter``
results and ``.metadata`` of the same save.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the steps --phases stamps (each one's start and end), in DCP's order
_SAVE_STEPS = ("set_up_planner", "set_up_storage_writer", "create_local_plan", "prepare_local_plan",
               "create_global_plan", "prepare_global_plan", "finish_plan", "write_data")
_LOAD_STEPS = ("read_metadata", "set_up_planner", "set_up_storage_reader", "create_local_plan",
               "prepare_local_plan", "create_global_plan", "prepare_global_plan", "finish_plan", "read_data")


def _stamped(cls: type, steps: tuple, stamps: dict) -> type:
    """``cls`` with each of ``steps`` recording its start and end time in
    ``stamps`` (the latest call's)."""
    import functools

    def wrap(name):
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def step(self, *args, **kwargs):
            stamps[name + "<"] = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                stamps[name + ">"] = time.perf_counter()
        return step

    return type(cls.__name__, (cls,), {n: wrap(n) for n in steps if hasattr(cls, n)})


def _phases(stamps: dict, steps: tuple, t0: float) -> dict:
    """Seconds per step and between steps (the gaps: DCP's own code and its
    collectives), from the call at ``t0``."""
    out: dict = {}
    last, last_name = t0, "call"
    for n in steps:
        if n + "<" not in stamps:
            continue
        out[f"{last_name}..{n}"] = stamps[n + "<"] - last
        out[n] = stamps[n + ">"] - stamps[n + "<"]
        last, last_name = stamps[n + ">"], n
    return out


def _planners(kind: str, caching: bool, stamps: dict | None = None):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner

    save, load = (FastPersistSavePlanner, FastPersistLoadPlanner) if kind == "fp" else \
        (DefaultSavePlanner, DefaultLoadPlanner)
    if stamps is not None:
        save, load = _stamped(save, _SAVE_STEPS, stamps["save"]), _stamped(load, _LOAD_STEPS, stamps["load"])
    return save(enable_plan_caching=caching), load()


def _rank(rank, world_size, root, n_tensors, saves, caching, kind, phases=False):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, FastPersistWriter

    class TimedWriter(FastPersistWriter):
        def prepare_local_plan(self, plan):
            t = time.perf_counter()
            try:
                self.sent = super().prepare_local_plan(plan)
                return self.sent
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

    class TimedReader(FastPersistReader):
        def prepare_local_plan(self, plan):
            self.sent = super().prepare_local_plan(plan)
            return self.sent

        def read_data(self, plan, planner):
            self.t_read = time.perf_counter()
            return super().read_data(plan, planner)

    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i // 8}.p{i % 8}": torch.randn(256, generator=g) for i in range(n_tensors)}
    sd["shared_embed"] = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1))
    stamps: dict = {"save": {}, "load": {}}
    if phases:
        TimedWriter = _stamped(TimedWriter, _SAVE_STEPS, stamps["save"])  # noqa: N806
        TimedReader = _stamped(TimedReader, _LOAD_STEPS, stamps["load"])  # noqa: N806
    out = []
    for s in range(saves):
        save_planner, load_planner = _planners(kind, caching, stamps if phases else None)
        w = TimedWriter(os.path.join(root, f"s{s}"))
        w.t_ours = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=w, planner=save_planner)
        t1 = time.perf_counter()
        w.close()
        r = TimedReader(os.path.join(root, f"s{s}"))
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        dist.barrier()
        t2 = time.perf_counter()
        dcp.load(target, storage_reader=r, planner=load_planner)
        t3 = time.perf_counter()
        r.close()
        out.append({
            "save_planning_s": w.t_write - t0, "ours_s": w.t_ours, "save_s": t1 - t0,
            "load_planning_s": r.t_read - t2, "load_s": t3 - t2,
            "save_plan_bytes": len(pickle.dumps(w.sent)), "load_plan_bytes": len(pickle.dumps(r.sent)),
            "dcp_cached": w.last_plan.get("dcp_cached"),
            **({"save_phases": _phases(stamps["save"], _SAVE_STEPS, t0),
                "load_phases": _phases(stamps["load"], _LOAD_STEPS, t2)} if phases else {}),
        })
    return out


def real_ranks(ranks: list[int], n_tensors: int, saves: int, kinds: list[str], cachings: tuple = (False, True),
               phases: bool = False) -> dict:
    from tests._dist import run_ranks

    results: dict = {}
    for ws in ranks:
        for caching in cachings:
            for kind in kinds:
                with tempfile.TemporaryDirectory() as d:
                    res = run_ranks(ws, _rank, d, n_tensors, saves, caching, kind, phases, timeout=1800)[0]
                results[f"{ws}r/{'caching' if caching else 'no_caching'}/{kind}"] = res
                for i, r in enumerate(res):
                    print(f"ranks={ws} caching={caching!s:5} planners={kind:3} save {i + 1}: "
                          f"save planning {r['save_planning_s'] * 1e3:7.1f} ms (fp_dcp's {r['ours_s'] * 1e3:6.1f}), "
                          f"load planning {r['load_planning_s'] * 1e3:7.1f} ms, plans sent "
                          f"{r['save_plan_bytes'] / 1e6:.2f} / {r['load_plan_bytes'] / 1e6:.2f} MB, "
                          f"dcp_cached={r['dcp_cached']}", flush=True)
                    for op in ("save", "load") if phases else ():
                        print(f"    {op} phases on the coordinator (ms): " + ", ".join(
                            f"{k} {v * 1e3:.1f}" for k, v in r[f"{op}_phases"].items()), flush=True)
    return results


def _sim_local_plans(world: int, items: int, kind: str, storage: bool = False) -> list[bytes]:
    """Every rank's pickled local plan, as that planner makes it (and, with
    ``storage``, as ``FastPersistWriter.prepare_local_plan`` hands it on)."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from fp_dcp import FastPersistOptions
    from fp_dcp.planners import _compact, _items
    from fp_dcp.save import plan as save_plan

    rows, cols = 4, 64
    size = torch.Size((rows * world, cols))
    props = _items.properties(torch.zeros(1))
    out = []
    for r in range(world):
        plan_items = []
        sizes = torch.Size((rows, cols))
        for i in range(items):
            off = torch.Size((r * rows, 0))
            fqn = f"layers.{i // 8}.p{i % 8}"
            if kind == "fp":  # shared objects, as FastPersistSavePlanner's local plans
                ch = _items.chunk(off, sizes)
                td = _items.tensor_data(ch, props, size)
                plan_items.append(_items.write_item(_items.index(fqn, off, None), WriteItemType.SHARD, td))
            else:  # one object per field, as DCP's _create_write_items_for_dtensor
                p = TensorProperties.create_from_tensor(torch.zeros(1))
                plan_items.append(WriteItem(
                    index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, torch.Size(sizes)),
                                                properties=p, size=torch.Size(size))))
        plan_items.append(WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO))
        if kind == "fp":  # gathered as columns, planned from them (as FastPersistSavePlanner's local plans)
            plan_items = _compact.WriteItems(plan_items)
            plan_items.lazy = True
        mappings = {it.index.fqn: (it.index.fqn,) for it in plan_items}
        if kind == "fp":  # as FastPersistSavePlanner's local plans
            mappings = _compact.FlatMappings(mappings)
        plan = SavePlan(plan_items, planner_data=mappings)
        if storage:
            opts = FastPersistOptions()
            plan = dataclasses.replace(plan, storage_data=save_plan.describe_rank(
                r, "host", list(plan_items), n_dirs=1, granularity=opts.split_alignment_bytes,
                small_bytes=opts.pack_threshold_bytes))
        out.append(pickle.dumps(plan))
    return out


def simulate(world: int, items: int, kind: str, storage: bool = True, restart: bool = False) -> dict:
    from fp_dcp import FastPersistWriter
    from fp_dcp.save import plan as save_plan

    save_planner, _ = _planners(kind, False)
    save_planner.is_coordinator = True
    sent = _sim_local_plans(world, items, kind, storage)
    with tempfile.TemporaryDirectory() as d:
        writer = FastPersistWriter(d)
        try:
            gc.collect()
            c0 = time.process_time()  # CPU time too: on a busy machine the wall clock also counts other processes
            t0 = time.perf_counter()
            was = gc.isenabled()  # both planners run as DCP runs them: the collector on
            plans = [pickle.loads(b) for b in sent]
            t1 = time.perf_counter()
            global_plans, metadata = save_planner.create_global_plan(plans)
            t2 = time.perf_counter()
            if storage:
                global_plans = writer.prepare_global_plan(global_plans)
            t3 = time.perf_counter()
            scatter = [pickle.dumps(p) for p in global_plans]
            t4 = time.perf_counter()
            c4 = time.process_time()
            assert was == gc.isenabled()
        finally:
            writer.close()
            save_plan.clear_plan_records()
            save_plan.PLACEMENTS.clear()  # each simulated save is a first one: placed, not recalled
    out = {"world": world, "items": items, "planners": kind, "gather_s": t1 - t0, "global_plan_s": t2 - t1,
           "storage_s": t3 - t2, "scatter_s": t4 - t3, "total_s": t4 - t0, "cpu_s": c4 - c0,
           "gathered_mb": sum(map(len, sent)) / 1e6, "scattered_mb": sum(map(len, scatter)) / 1e6,
           "metadata_entries": len(metadata.state_dict_metadata)}
    if restart:
        out.update(_restart_metadata(metadata, global_plans))
    return out


def _restart_metadata(metadata, global_plans) -> dict:
    """The commit of the simulated save (every item one extent of its
    rank's file) and the time each rank of a restart spends reading its
    metadata back, beside DCP's ``FileSystemWriter`` / reader on the same
    save.  The commit: every rank's write results gathered on the
    coordinator (the unpickling is timed; DCP gathers them with
    ``gather_object``), then fp_dcp's layout, its check and the metadata
    file's bytes (the part of the file that depends on the structure alone
    is encoded while the coordinator's own data is written: timed apart),
    against DCP's results of ``WriteResult`` + ``_StorageInfo`` per item and
    ``pickle.dumps`` of its ``.metadata``.  The restart: ``fp_dcp.format``'s
    decoder against ``pickle.loads`` of that ``.metadata``, once the objects
    made for the commit are freed (a restarting process holds none of them)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from fp_dcp import format as fmt
    from fp_dcp.gc_freeze import paused
    from fp_dcp.save.results import RankResults, check_layout_covers, layout_from_results

    save_id, sent, stock_sent = "20260101T000000-0123abcd", [], []
    for r, plan in enumerate(global_plans):
        name, at, rows, stock = fmt.data_file_name(save_id, r, 0), 0, [], []
        for li, item in enumerate(plan.items):
            td = item.tensor_data
            n = 64 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
            rows.append((li, name, at, 0, n, "0" * 8))
            stock.append(WriteResult(item.index, n, _StorageInfo(f"__{r}_0.distcp", at, n)))
            at += -(-n // 4096) * 4096
        # each rank's results as write_data returns them, pickled as DCP's gather does
        sent.append(pickle.dumps(RankResults.of_rows([i.index for i in plan.items], rows, {name: at})))
        stock_sent.append(pickle.dumps(stock))
    with paused():  # as the writer's commit and the reader's read_metadata run them
        t0 = time.perf_counter()
        structure = fmt.encode_structure(metadata)
        t1 = time.perf_counter()
        results = [pickle.loads(b) for b in sent]
        t2 = time.perf_counter()
        layout = layout_from_results(results, save_id, 4096)
        check_layout_covers(metadata, layout, structure)
        blob = fmt.encode_metadata(metadata, layout, {"writer": "simulated", "torch_version": "", "created": 0.0,
                                                      "world_size": len(results)}, structure)
        t3 = time.perf_counter()
    stock_results = [pickle.loads(b) for b in stock_sent]
    t4 = time.perf_counter()
    stock = dataclasses.replace(metadata, storage_data={wr.index: wr.storage_data for rr in stock_results for wr in rr})
    stock_blob = pickle.dumps(stock)
    t5 = time.perf_counter()
    out = {"metadata_mb": len(blob) / 1e6, "structure_encode_s": t1 - t0, "results_gather_s": t2 - t1,
           "results_mb": sum(map(len, sent)) / 1e6, "commit_s": t3 - t2, "stock_results_gather_s": t4 - t3,
           "stock_results_mb": sum(map(len, stock_sent)) / 1e6, "stock_commit_s": t5 - t4,
           "stock_metadata_mb": len(stock_blob) / 1e6}
    # a restarting rank holds none of the save's objects: those made here are freed before the decodes
    del sent, stock_sent, results, layout, structure, stock_results, stock
    gc.collect()
    with paused():  # as the reader's read_metadata runs it
        t6 = time.perf_counter()
        fmt.decode_metadata(blob, "simulated")
        t7 = time.perf_counter()
    pickle.loads(stock_blob)  # as DCP's FileSystemReader does
    t8 = time.perf_counter()
    return {**out, "metadata_decode_s": t7 - t6, "stock_metadata_load_s": t8 - t7}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2", help="comma list of real world sizes (0: none)")
    ap.add_argument("--tensors", type=int, default=9245)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--planners", default="dcp,fp", help="comma list from: dcp (DCP's defaults), fp (fp_dcp's)")
    ap.add_argument("--simulate", default="", help="comma list of RANKSxITEMS, e.g. 64x1000,1024x2000")
    ap.add_argument("--caching", default="off,on", help="comma list from: off, on (DCP's plan caching)")
    ap.add_argument("--storage", default="on", choices=("on", "off"),
                    help="simulated: time FastPersistWriter.prepare_global_plan too (and send what it needs)")
    ap.add_argument("--restart", action="store_true",
                    help="simulated: also encode the save's metadata file and time what each rank of a restart "
                         "spends decoding it, beside DCP's pickled .metadata of the same save")
    ap.add_argument("--phases", action="store_true",
                    help="also print the coordinator's time per planning step and between steps")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    kinds = [k for k in args.planners.split(",") if k]
    ranks = [int(r) for r in args.ranks.split(",") if int(r) > 0]
    cachings = tuple({"off": False, "on": True}[c] for c in args.caching.split(",") if c)
    results: dict = {"real": real_ranks(ranks, args.tensors, args.saves, kinds, cachings, args.phases) if ranks else {},
                     "simulated": []}
    for spec in [s for s in args.simulate.split(",") if s]:
        world, items = (int(x) for x in spec.lower().split("x"))
        for kind in kinds:
            r = simulate(world, items, kind, args.storage == "on", args.restart)
            results["simulated"].append(r)
            print(f"simulated {world} ranks x {items} items, planners={kind:3}: coordinator "
                  f"{r['total_s']:7.2f} s, CPU {r['cpu_s']:.2f} s (gather {r['gather_s']:.2f} s of {r['gathered_mb']:.0f} MB, "
                  f"global plan {r['global_plan_s']:.2f} s, storage {r['storage_s']:.2f} s, scatter "
                  f"{r['scatter_s']:.2f} s of {r['scattered_mb']:.0f} MB)", flush=True)
            if args.restart:
                print(f"    its commit: write results gathered in {r['results_gather_s']:.2f} s "
                      f"({r['results_mb']:.0f} MB), layout and metadata file ({r['metadata_mb']:.0f} MB) in "
                      f"{r['commit_s']:.2f} s, after {r['structure_encode_s']:.2f} s while writing; DCP's: "
                      f"{r['stock_results_gather_s']:.2f} s ({r['stock_results_mb']:.0f} MB), pickled .metadata "
                      f"({r['stock_metadata_mb']:.0f} MB) in {r['stock_commit_s']:.2f} s\n"
                      f"    each rank of a restart decodes the metadata in {r['metadata_decode_s']:.2f} s "
                      f"(DCP's .metadata: loaded in {r['stock_metadata_load_s']:.2f} s)", flush=True)
            gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
