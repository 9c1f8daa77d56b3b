#!/usr/bin/env python
"""Save / cold-load throughput of fp_dcp against stock DCP, torch.save and the raw device.

Each contender runs in a fresh subprocess which regenerates the same seeded
state dict, times only dcp.save (or the load into preallocated, zeroed
tensors), and reports its RSS after generation and its peak RSS during the
timed operation. Loads are verified bit for bit before they count. Contenders
alternate (A B C A B C ...) over --repeat rounds; the table gives the median,
min and max GB/s (1 GB = 1e9 bytes of tensor payload per second), the
ratios fp_dcp / raw device and fp_dcp / stock, and PASS/FAIL against the
project's targets. JSON with the machine description goes to --json.

    python benchmarks/bench_save_load.py --quick                 # smoke test
    python benchmarks/bench_save_load.py --size 4GiB --mix both  # the real run
    python benchmarks/bench_save_load.py --engines aio,uring --repeat 5
    python benchmarks/bench_save_load.py --profiles bare,throttled --throttle-iops 1000

Contenders: fp_dcp, fp_dcp[noverify] (the same reader with verify_checksums
off, same rounds), stock FileSystemWriter/Reader, torch_checkpointing (the
peer, the ``bench`` extra), torch.save, and the raw device (fio at 1, 4 and
16 MiB and fp_dcp's engine into one huge-page buffer: the best is the raw
reference).  Each runs in every device profile: ``bare`` and ``throttled``
(cgroup v1 blkio IOPS limits, root only; see benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from fp_dcp.options import parse_size  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]

# Targets ("Done when"): ratio name -> minimum (or maximum for RSS).
SAVE_VS_RAW = {"large": 0.90, "small": 0.80}
SAVE_VS_STOCK = 3.0
LOAD_VS_RAW = {"large": 0.90, "small": 0.70}
LOAD_VS_STOCK = 1.5
VERIFY_VS_NOVERIFY = 0.95  # verified load within 5 % of the same load unverified
PEER_MIN = 1.0
RSS_OVERHEAD_MAX = 300 * C.MiB


# ==========================================================================
# child side


def _fp_dcp_import():
    """The API from an installed fp_dcp, else from the repository checkout."""
    fp = C.import_fp_dcp()
    return fp.FastPersistWriter, fp.FastPersistReader, fp.FastPersistOptions


def _tc_manager():
    """torch_checkpointing's fastest correct CPU configuration here: a
    synchronous save (its async saver's staging defaults need CUDA) through
    buffered files.  Its default ``use_direct_io=True`` fails on this ext4
    (torch.save's zip writer issues unaligned writes: EINVAL at close)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return CheckpointManager(CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def _tc_key(key: str) -> str:
    """torch_checkpointing takes only file-name-safe item keys ([a-zA-Z0-9_-]):
    every other character (``.`` of module paths, and ``-``) as ``-xx`` hex."""
    import re

    return re.sub(r"[^a-zA-Z0-9_]", lambda m: f"-{ord(m.group()):02x}", key)


def _fsync_tree(path: Path) -> None:
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _null_storage():
    """A writer and a reader that move no bytes: DCP's own work alone.

    ``dcp_floor`` times ``dcp.save`` / ``dcp.load`` through them: the
    planning, the per-key wrappers and checks DCP does around any storage.
    No storage can go below it, so ``raw / (raw + floor)`` is the best
    ratio to the raw device any DCP storage can reach on this machine."""
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.futures import Future

    def done(value):
        f = Future()
        f.set_result(value)
        return f

    class Passive:
        """What both leave as DCP hands it: no plan changes, any id."""

        def reset(self, checkpoint_id=None):
            pass

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return True

    class NullWriter(Passive, StorageWriter):
        metadata = None

        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            pass

        def write_data(self, plan, planner):
            return done([])

        def finish(self, metadata, results):
            self.metadata = metadata

    class NullReader(Passive, StorageReader):
        def __init__(self, metadata):
            self.metadata = metadata

        def read_metadata(self, *args, **kwargs):
            return self.metadata

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            pass

        def read_data(self, plan, planner):
            return done(None)

    return NullWriter, NullReader


def _planner_kwargs(planners: str | None) -> dict:
    """``{"save": {"planner": ...}, "load": {...}}`` for fp_dcp's planners
    (``"fp"``), ``{}`` for DCP's defaults (``None`` / ``"dcp"``)."""
    if planners in (None, "dcp"):
        return {}
    from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner

    return {"save": {"planner": FastPersistSavePlanner()}, "load": {"planner": FastPersistLoadPlanner()}}


def _child(spec: dict) -> dict:
    warnings.filterwarnings("ignore")
    kind, op = spec["kind"], spec["op"]
    if kind == "probe":
        try:
            _fp_dcp_import()
            import fp_dcp
            return {"ok": True, "version": getattr(fp_dcp, "__version__", "?"),
                    "file": getattr(fp_dcp, "__file__", None)}
        except Exception as e:  # any import failure means: skip fp_dcp
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    path = Path(spec["path"])
    if kind == "raw":
        path.mkdir(parents=True, exist_ok=True)
        load = op != "save"
        block, depth = ((spec.get("read_block_size", spec["block_size"]), spec.get("read_iodepth", spec["iodepth"]))
                        if load else (spec["block_size"], spec["iodepth"]))
        if spec.get("default_shapes"):  # a default writer's and reader's, in this profile
            block, depth = _io_shapes(path)["read" if load else "write"]
        r = C.raw_device_io("read" if load else "write", path / "raw.bin", spec["bytes"], method=spec["method"],
                            block_size=block, iodepth=depth, numjobs=spec.get("numjobs", 1),
                            rewrite=bool(spec.get("rewrite")))
        return {"ok": True, "verified": None, **r}

    import torch
    import torch.distributed.checkpoint as dcp

    if kind == "fp_dcp":
        Writer, Reader, Options = _fp_dcp_import()

    sd_spec = C.make_spec(spec["mix"], spec["size_bytes"], spec["seed"])
    factory = C.StateDictFactory(sd_spec)
    nbytes = sd_spec.payload_bytes
    sd = factory.build(zero=(op == "load"))
    originals = {t.key: sd[t.key] for t in sd_spec.tensors}
    if op == "load":
        for dt in {t.dtype for t in sd_spec.tensors}:  # pools for verification: before the baseline
            factory.pools.get(dt)
    import gc
    gc.collect()
    gen_peak = C.peak_rss_bytes()
    base = C.rss_bytes()
    reset_ok = C.reset_peak_rss()

    engine = spec.get("engine")
    extra: dict = {}
    plan = _planner_kwargs(spec.get("planners"))  # {} for DCP's default planners
    if kind == "dcp_floor" and op == "load":
        NullWriter, NullReader = _null_storage()
        w = NullWriter()
        dcp.save(sd, storage_writer=w)  # the metadata of these shapes, outside the clock
        null_reader = NullReader(w.metadata)
    if op == "save":
        t0 = time.perf_counter()
        if kind == "fp_dcp":
            w = Writer(str(path), options=Options(engine=engine) if engine else None,
                       **({"recycle": spec["recycle_from"]} if spec.get("recycle_from") else {}))
            dcp.save(sd, storage_writer=w, **plan.get("save", {}))
            extra["zero_copy_bytes"] = w.last_stats.get("zero_copy_bytes", 0)  # written straight from the tensors
        elif kind == "stock":
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path),
                                                             thread_count=spec["threads"]))
        elif kind == "torch_checkpointing":
            m = _tc_manager()
            m.save(str(path), {_tc_key(k): v for k, v in sd.items()})
            m.close()
            _fsync_tree(path)  # it does not fsync: the clock stops when its files are durable
        elif kind == "dcp_floor":
            dcp.save(sd, storage_writer=_null_storage()[0](), **plan.get("save", {}))
        elif kind == "torch_save":
            path.mkdir(parents=True, exist_ok=True)
            with open(path / "state_dict.pt", "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            raise ValueError(f"unknown contender kind {kind!r}")
        seconds = time.perf_counter() - t0
        peak = C.peak_rss_bytes()
        verified = None
        errors: list[str] = []
    else:
        t0 = time.perf_counter()
        if kind == "fp_dcp":
            kw = {"verify_checksums": spec.get("verify", True)}
            if engine:
                kw["engine"] = engine
            if spec.get("read_threads"):
                kw["read_threads"] = spec["read_threads"]
            r = Reader(str(path), **kw)
            dcp.load(sd, storage_reader=r, **plan.get("load", {}))
            extra["checksum_bytes"] = r.last_stats.get("checksum_bytes", 0)
            extra["checksum_verified_bytes"] = r.last_stats.get("checksum_verified_bytes", 0)
            extra["bytes_read"] = r.last_stats.get("bytes_read", 0)
            extra["direct_bytes"] = r.last_stats.get("direct_bytes", 0)  # read straight into the tensors
            # the reader's own share of the clock (the rest is DCP's planning
            # and the first load's set-up in a fresh process)
            extra["reader_seconds"] = r.last_stats.get("seconds")
            extra["engine_read_seconds"] = r.last_stats.get("read_seconds")
        elif kind == "torch_checkpointing":
            m = _tc_manager()
            names = {_tc_key(k): k for k in sd}
            loaded = m.load(str(path), into={_tc_key(k): v for k, v in sd.items()})
            m.close()
            for k, v in (loaded or {}).items():  # non-tensor items come back in the result
                if not isinstance(sd.get(names[k]), torch.Tensor):
                    sd[names[k]] = v
        elif kind == "stock":
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
        elif kind == "dcp_floor":
            dcp.load(sd, storage_reader=null_reader, **plan.get("load", {}))
        elif kind == "torch_save":
            loaded = torch.load(path / "state_dict.pt", weights_only=True)
            for k, v in loaded.items():  # into the preallocated tensors, like the others
                if isinstance(v, torch.Tensor) and isinstance(sd.get(k), torch.Tensor):
                    sd[k].copy_(v)
                else:
                    sd[k] = v
            del loaded
        else:
            raise ValueError(f"unknown contender kind {kind!r}")
        seconds = time.perf_counter() - t0
        peak = C.peak_rss_bytes()
        errors = [] if kind == "dcp_floor" else factory.verify(sd, originals)  # it reads nothing
        verified = None if kind == "dcp_floor" else not errors
    return {
        "ok": not errors, "seconds": seconds, "bytes": nbytes, "verified": verified,
        "errors": errors, "rss_base_bytes": base, "rss_peak_bytes": peak,
        "rss_overhead_bytes": peak - base if reset_ok else max(0, peak - base),
        "peak_reset": reset_ok, "generation_peak_bytes": gen_peak,
        "torch_threads": torch.get_num_threads(), **extra,
    }


def child_main(spec_json: str) -> None:
    try:
        result = _child(json.loads(spec_json))
    except BaseException as e:  # report, don't crash without a result line
        import traceback
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc().splitlines()[-6:]}
    C.emit_result(result)


# ==========================================================================
# parent side


def _short(err: str | None, limit: int = 300) -> str:
    """One line from a (possibly multi-line) error: its first and last lines."""
    lines = [ln.strip() for ln in (err or "").splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _jobs_by_depth(shape: str) -> tuple[int, int]:
    """``"4x32"`` -> (4 jobs, queue depth 32)."""
    try:
        jobs, qd = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--raw-jobs: {shape!r} is not JOBSxDEPTH (e.g. 4x32)") from None
    return jobs, qd


def build_contenders(args, fp_ok: bool, raw_method: str) -> list[dict]:
    cs: list[dict] = []
    want = set(args.contenders.split(","))
    if "fp_dcp" in want and fp_ok:
        cs.append({"name": "fp_dcp", "kind": "fp_dcp", "engine": None, "role": "fp_dcp"})
        if not args.no_verify_row:
            # the same default reader with verification off, in the same rounds:
            # the row that catches a verifier slower than the device
            # it loads fp_dcp's checkpoint of the round, right before or after
            # fp_dcp's own load (alternating), so the device is the same
            cs.append({"name": "fp_dcp[noverify]", "kind": "fp_dcp", "engine": None, "verify": False,
                       "role": "fp_dcp_noverify", "loads_of": "fp_dcp"})
        if args.again_row:
            # the same verified reader again, back to back: how far two
            # identical loads of one checkpoint differ on this machine, the
            # noise under the verify-off row's comparison
            cs.append({"name": "fp_dcp[again]", "kind": "fp_dcp", "engine": None,
                       "role": "fp_dcp_again", "loads_of": "fp_dcp"})
        for e in filter(None, args.engines.split(",")):
            cs.append({"name": f"fp_dcp[{e}]", "kind": "fp_dcp", "engine": e, "role": "fp_dcp_engine"})
        for n in filter(None, args.read_threads.split(",")):
            cs.append({"name": f"fp_dcp[read_threads={int(n)}]", "kind": "fp_dcp", "engine": None,
                       "read_threads": int(n), "role": "fp_dcp_engine"})
    if "fp_dcp_thp" in want and fp_ok:
        # the same writer and reader, the state dict allocated by torch with
        # THP_MEM_ALLOC_ENABLE=1: tensors of 2 MiB and more start on a page
        # (and sit on huge pages), so they go straight to and from the device
        cs.append({"name": "fp_dcp[thp]", "kind": "fp_dcp", "engine": None, "role": "fp_dcp_engine",
                   "env": {"THP_MEM_ALLOC_ENABLE": "1"}})
    if "fp_dcp_recycle" in want and fp_ok:
        # the same writer recycling the checkpoint of the round before (the
        # one rotation would delete): it writes over that checkpoint's blocks
        # instead of new ones; compared with raw[hugebuf,rewrite]
        cs.append({"name": "fp_dcp[recycle]", "kind": "fp_dcp", "engine": None, "role": "fp_dcp_engine",
                   "recycle": True})
    if "stock" in want:
        cs.append({"name": "stock", "kind": "stock", "threads": 1, "role": "stock"})
        if args.stock_threads and args.stock_threads != 1:
            cs.append({"name": f"stock-t{args.stock_threads}", "kind": "stock",
                       "threads": args.stock_threads, "role": "stock_tuned"})
    if "torch_checkpointing" in want:
        cs.append({"name": "torch_checkpointing", "kind": "torch_checkpointing", "role": "peer"})
    if "torch.save" in want:
        cs.append({"name": "torch.save", "kind": "torch_save", "role": "torch_save"})
    if "dcp_floor" in want:
        cs.append({"name": "dcp_floor", "kind": "dcp_floor", "role": "dcp_floor"})
    if "dcp_floor_fp" in want and fp_ok:
        # the same with fp_dcp's planners: the ceiling of a storage used with them
        cs.append({"name": "dcp_floor_fp", "kind": "dcp_floor", "role": "dcp_floor", "planners": "fp"})
    if "raw" in want:
        shapes = [(1, args.raw_iodepth)]
        if raw_method == "fio":
            shapes += [_jobs_by_depth(s) for s in filter(None, args.raw_jobs.split(","))]
        for bs in args.raw_bs.split(","):
            b = parse_size(bs)
            for jobs, qd in shapes:
                cs.append({"name": f"raw[{raw_method},{bs.strip()}" + (f",{jobs}x{qd}]" if jobs > 1 else "]"),
                           "kind": "raw", "method": raw_method, "block_size": b, "numjobs": jobs,
                           "iodepth": qd if raw_method == "fio" else 1, "role": "raw"})
        # the device without fio's 4 KiB-page buffers: fp_dcp's engine, one
        # huge-page buffer, the writer's shape under a per-operation limit
        # (4M x 8) and the reader's engine of scattered runs (256K x 64)
        cs.append({"name": "raw[hugebuf]", "kind": "raw", "method": "hugebuf", "role": "raw",
                   "block_size": 4 * C.MiB, "iodepth": 8, "read_block_size": 256 * C.KiB, "read_iodepth": 64})
        # and reads in the large shape: a device that charges per operation
        # (the throttled profile) reads 256 KiB requests at 1/16 the bandwidth
        cs.append({"name": "raw[hugebuf,4M]", "kind": "raw", "method": "hugebuf", "role": "raw",
                   "block_size": 4 * C.MiB, "iodepth": 8, "read_block_size": 4 * C.MiB, "read_iodepth": 8})
        # and both directions in the writer's shape without such a limit (1M x 32)
        cs.append({"name": "raw[hugebuf,1M]", "kind": "raw", "method": "hugebuf", "role": "raw",
                   "block_size": 1 * C.MiB, "iodepth": 32, "read_block_size": 1 * C.MiB, "read_iodepth": 32})
        if "fp_dcp_recycle" in want:
            # a default writer's shape in this profile, over the blocks of the
            # file the round before wrote: the raw reference of a recycled save
            # (not of the others, which write new files)
            cs.append({"name": "raw[hugebuf,rewrite]", "kind": "raw", "method": "hugebuf", "role": "raw_rewrite",
                       "rewrite": True, "default_shapes": True, "block_size": 1 * C.MiB, "iodepth": 32})
    for c in cs:
        if c["kind"] == "fp_dcp":
            c["planners"] = args.planners  # every fp_dcp row, so that they compare with each other
    return cs


def _raw_read_of(path: Path) -> float:
    """One cold raw read (fp_dcp's engine into one huge-page buffer, in the
    shape a default reader reads long runs with) of the data files of the
    checkpoint at ``path``: GB/s.  Taken just before and just after each
    fp_dcp load, which is compared with the two (the device's speed drifts
    over a run)."""
    files = [f for f in sorted(path.iterdir()) if f.is_file() and not f.name.startswith(".")]
    block, depth = _io_shapes(path)["read"]
    C.drop_caches()
    nbytes = seconds = 0.0
    for f in files:
        size = f.stat().st_size // block * block  # raw_device_io reads whole requests
        if size:
            r = C.raw_device_io("read", f, size, method="hugebuf", block_size=block, iodepth=depth)
            nbytes += r["bytes"]
            seconds += r["seconds"]
    return nbytes / seconds / 1e9 if seconds else 0.0


def _io_shapes(directory: Path) -> dict[str, tuple[int, int]]:
    """{"write", "read"}: (block size, queue depth) of a default writer's
    requests to ``directory`` and of a default reader's for long runs, from
    this process: the device's tuning record's, else the built-in rule (which
    asks this process's cgroup, so call it inside the device profile)."""
    from fp_dcp.tools.tune import builtin_shapes
    from fp_dcp import tuning

    tuned = tuning.lookup(str(directory))
    if tuned is not None:
        return {"write": tuple(tuned.write), "read": tuple(tuned.read)}
    return {op: tuple(shape) for op, shape in builtin_shapes(str(directory)).items()}


def _raw_write_beside(path: Path, nbytes: int, rewrite: bool = False) -> float:
    """One raw write (fp_dcp's engine from one huge-page buffer, in the shape a
    default writer sends, fsync in the clock) of ``nbytes`` into a new file
    beside ``path``, then removed: GB/s.  Taken just before and just after
    each fp_dcp save, which is compared with the two, as each load is with
    raw reads of its files.  ``rewrite`` (a recycled save's): over the blocks
    of the file the write before left, kept for the next (see _clean_kept)."""
    f = path.parent / f"{path.name}.raw-write"
    block, depth = _io_shapes(path.parent)["write"]
    try:
        r = C.raw_device_io("write", f, nbytes, method="hugebuf", block_size=block, iodepth=depth, rewrite=rewrite)
    finally:
        if not rewrite:
            f.unlink(missing_ok=True)
    return r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0


def _contender_dir(workdir: Path, mix: str, c: dict) -> Path:
    """Where contender ``c`` saves the mix ``mix``."""
    return workdir / f"{mix}-{c['name'].replace('[', '_').replace(']', '').replace(',', '_')}"


def _clean_kept(path: Path) -> None:
    """Remove what a recycling or rewriting contender keeps from round to round."""
    for p in (path, path.with_name(path.name + ".prev")):
        shutil.rmtree(p, ignore_errors=True)
    path.with_name(path.name + ".raw-write").unlink(missing_ok=True)


def run_mix(args, mix: str, contenders: list[dict], workdir: Path, can_drop: bool) -> dict:
    sd_spec = C.make_spec(mix, args.size_bytes, args.seed)
    nbytes = sd_spec.payload_bytes
    print(f"\n== mix {mix}: {len(sd_spec.tensors)} tensors, {len(sd_spec.objects)} non-tensor items, "
          f"{C.fmt_size(nbytes)} payload; {args.repeat} round(s) ==", flush=True)
    runs: dict[str, dict[str, list[dict]]] = {c["name"]: {"save": [], "load": []} for c in contenders}

    def one(c: dict, op: str, base: dict, rnd: int) -> dict:
        cold = C.drop_caches()[0] if can_drop else False
        r = C.run_child(SCRIPT, {**base, "op": op}, timeout_s=args.child_timeout, extra_env=c.get("env"))
        r["cold"] = cold if op == "load" else None
        if r.get("ok") and r.get("seconds"):
            r["gbps"] = r["bytes"] / r["seconds"] / 1e9
        runs[c["name"]][op].append(r)
        status = (f"{r['gbps']:.2f} GB/s" if r.get("gbps")
                  else "FAILED: " + _short(r.get("error") or "; ".join(r.get("errors", []))))
        rss = (f"  rss +{C.fmt_size(r['rss_overhead_bytes'])}"
               if r.get("rss_overhead_bytes") is not None else "")
        print(f"  round {rnd + 1} {c['name']:<18} {op:<4} {status}{rss}", flush=True)
        return r

    for rnd in range(args.repeat):
        for c in contenders:
            if c.get("loads_of"):
                continue  # loads with the contender whose checkpoint it reads
            path = _contender_dir(workdir, mix, c)
            recycling = bool(c.get("recycle"))
            if not (recycling or c.get("rewrite")):  # (those keep the round before's files to write over)
                shutil.rmtree(path, ignore_errors=True)
            # the child rebuilds the spec from (mix, size, seed): a full spec of
            # thousands of tensors would exceed the kernel's 128 KiB argv string limit
            extra = dict(path=str(path), mix=mix, size_bytes=args.size_bytes, seed=args.seed, bytes=nbytes)
            base = {**{k: v for k, v in c.items() if k not in ("name", "role", "env", "recycle")}, **extra}
            if recycling:
                prev = path.with_name(path.name + ".prev")
                shutil.rmtree(prev, ignore_errors=True)
                if not path.exists():  # a first checkpoint to recycle, outside the clock
                    C.run_child(SCRIPT, {**base, "op": "save"}, timeout_s=args.child_timeout, extra_env=c.get("env"))
                os.rename(path, prev)
                base["recycle_from"] = str(prev)
            ours = c["kind"] == "fp_dcp"
            raw = [_raw_write_beside(path, nbytes, recycling)] if ours else []
            saved = one(c, "save", base, rnd)
            if ours:
                raw.append(_raw_write_beside(path, nbytes, recycling))
                saved["raw_around_gbps"] = raw
            if not saved.get("ok"):
                runs[c["name"]]["load"].append({"ok": False, "error": "save failed, nothing to load"})
                continue
            loaders = [(c, base)] + [
                (o, {**{k: v for k, v in o.items() if k not in ("name", "role", "loads_of")}, **extra})
                for o in contenders if o.get("loads_of") == c["name"]]
            if rnd % 2:
                loaders.reverse()  # alternate which goes first
            paired = ours and can_drop  # a raw read is cold only where caches can be dropped
            raw = [_raw_read_of(path)] if paired else []
            for o, b in loaders:
                r = one(o, "load", b, rnd)
                if paired:
                    raw.append(_raw_read_of(path))
                    r["raw_around_gbps"] = raw[-2:]
            if not args.keep and not (recycling or c.get("rewrite")):
                shutil.rmtree(path, ignore_errors=True)
    if not args.keep:
        for c in contenders:
            if c.get("recycle") or c.get("rewrite"):
                _clean_kept(_contender_dir(workdir, mix, c))
    return {"mix": mix, "tensors": len(sd_spec.tensors), "objects": len(sd_spec.objects),
            "payload_bytes": nbytes, "runs": runs}


def _summaries(mix_result: dict, contenders: list[dict]) -> dict:
    out = {}
    for c in contenders:
        out[c["name"]] = {}
        for op in ("save", "load"):
            rs = mix_result["runs"][c["name"]][op]
            ok = [r for r in rs if r.get("ok")]
            failed = [r for r in rs if not r.get("ok")]
            s = C.summarize([r["gbps"] for r in ok])
            ov = [r["rss_overhead_bytes"] for r in ok if r.get("rss_overhead_bytes") is not None]
            base = [r["rss_base_bytes"] for r in ok if r.get("rss_base_bytes") is not None]
            paired = [r["gbps"] * 2 / sum(r["raw_around_gbps"]) for r in ok if sum(r.get("raw_around_gbps") or [0])]
            s.update(failed=len(failed), role=c["role"],
                     vs_paired_raw=C.summarize(paired) if paired else None,
                     rss_overhead_max_bytes=max(ov) if ov else None,
                     rss_base_bytes=max(base) if base else None,
                     cold=all(r.get("cold") for r in ok) if op == "load" and ok else None,
                     first_error=(failed[0].get("error") or "; ".join(failed[0].get("errors", [])))
                     if failed else None,
                     note=ok[0].get("note") if ok else None)
            out[c["name"]][op] = s
    # verified against unverified, round by round (the two loads of a round
    # read the same checkpoint back to back)
    runs = mix_result["runs"]
    for other, key in (("fp_dcp[noverify]", "vs_noverify"), ("fp_dcp[again]", "vs_again")):
        if "fp_dcp" in out and other in out:
            pairs = [a["gbps"] / b["gbps"] for a, b in zip(runs["fp_dcp"]["load"], runs[other]["load"])
                     if a.get("ok") and b.get("ok") and a.get("gbps") and b.get("gbps")]
            out["fp_dcp"]["load"][key] = C.summarize(pairs) if pairs else None
    return out


def _ceiling(rows: list[dict], name: str, op: str, raw_gbps: float | None, floor_gbps: float | None,
             floor_name: str = "dcp_floor", what: str = "ceiling: raw + DCP's own time, any storage") -> None:
    """The best ratio to raw any DCP storage can reach in this run: the raw
    transfer plus DCP's own time (``dcp_floor``), which no storage can
    overlap with its I/O (it runs before the storage sees a tensor, or after
    it has returned).  Both are GB/s of the same payload, so the seconds'
    ratio is ``raw / (raw + floor)`` = ``1 / (1 + raw_gbps / floor_gbps)``."""
    if raw_gbps and floor_gbps:
        cap = 1 / (1 + raw_gbps / floor_gbps)
        rows.append({"contender": name, "op": op, "baseline": floor_name,
                     "vs": what, "ratio": cap,
                     "value": f"{cap:.2f}x of raw", "target": "", "verdict": ""})


def _paired(rows: list[dict], name: str, op: str, s: dict, what: str) -> None:
    """The row of ``op`` against the raw transfers just before and after it
    (the device's speed drifts over a run), where they were taken."""
    pr = s[op].get("vs_paired_raw")
    if pr:
        rows.append({"contender": name, "op": op, "baseline": "", "vs": what, "ratio": pr["median"],
                     "value": f"{pr['median']:.2f}x ({pr['min']:.2f}-{pr['max']:.2f})", "target": "", "verdict": ""})


def _ratios(mix: str, summ: dict, contenders: list[dict]) -> list[dict]:
    def best(role: str, op: str):
        vals = [(summ[c["name"]][op]["median"], c["name"]) for c in contenders
                if c["role"] == role and summ[c["name"]][op]["median"]]
        return max(vals) if vals else (None, None)

    raw_w, raw_w_name = best("raw", "save")
    rewrite_w, rewrite_w_name = best("raw_rewrite", "save")
    peer = {op: summ["torch_checkpointing"][op]["median"] if "torch_checkpointing" in summ else None
            for op in ("save", "load")}
    raw_r, raw_r_name = best("raw", "load")
    stock = {op: summ["stock"][op]["median"] if "stock" in summ else None for op in ("save", "load")}
    floor = {op: summ["dcp_floor"][op]["median"] if "dcp_floor" in summ else None for op in ("save", "load")}
    floor_fp = {op: summ["dcp_floor_fp"][op]["median"] if "dcp_floor_fp" in summ else None for op in ("save", "load")}
    tuned_name = next((c["name"] for c in contenders if c["role"] == "stock_tuned"), None)
    tuned = {op: summ[tuned_name][op]["median"] if tuned_name else None for op in ("save", "load")}
    rows = []
    for c in contenders:
        if c["kind"] != "fp_dcp":
            continue
        s = summ[c["name"]]
        targets = c["role"] == "fp_dcp"

        def add(op, what, num, den, den_name, minimum=None):
            if den_name in ("fp_dcp[noverify]", "torch_checkpointing") and den_name not in summ:
                return
            ratio = num / den if num and den else None
            verdict = ""
            if targets and minimum is not None:
                verdict = "n/a" if ratio is None else ("PASS" if ratio >= minimum else "FAIL")
            rows.append({"contender": c["name"], "op": op, "vs": what, "baseline": den_name,
                         "ratio": ratio, "target": f">= {minimum:.2f}x" if minimum else "",
                         "verdict": verdict})

        if c.get("recycle"):  # it writes over existing blocks: so does its raw reference
            add("save", "raw write over existing blocks", s["save"]["median"], rewrite_w, rewrite_w_name)
        add("save", "raw write", s["save"]["median"], raw_w, raw_w_name, SAVE_VS_RAW[mix])
        _paired(rows, c["name"], "save", s, "paired raw (a write of as many bytes, just before and after; "
                                            "median of rounds)")
        if targets:
            _ceiling(rows, c["name"], "save", raw_w, floor["save"])
            _ceiling(rows, c["name"], "save", raw_w, floor_fp["save"], "dcp_floor_fp",
                     "ceiling: raw + DCP's own time with fp_dcp's planners")
        add("save", "stock default", s["save"]["median"], stock["save"], "stock", SAVE_VS_STOCK)
        add("save", "stock tuned", s["save"]["median"], tuned["save"], tuned_name)
        add("load", "raw read", s["load"]["median"], raw_r, raw_r_name, LOAD_VS_RAW[mix])
        if targets:
            _ceiling(rows, c["name"], "load", raw_r, floor["load"])
            _ceiling(rows, c["name"], "load", raw_r, floor_fp["load"], "dcp_floor_fp",
                     "ceiling: raw + DCP's own time with fp_dcp's planners")
        _paired(rows, c["name"], "load", s, "paired raw (its own files, just before and after; median of rounds)")
        add("load", "stock reader", s["load"]["median"], stock["load"], "stock", LOAD_VS_STOCK)
        add("load", "stock tuned ckpt", s["load"]["median"], tuned["load"], tuned_name)
        if c["role"] == "fp_dcp":
            vn = s["load"].get("vs_noverify")
            if vn:  # the worst round must be within the bound
                rows.append({"contender": c["name"], "op": "load", "baseline": "fp_dcp[noverify]",
                             "vs": "verify off (same checkpoint, back to back; worst round)",
                             "ratio": vn["min"], "value": f"{vn['min']:.2f}x (median {vn['median']:.2f}x)",
                             "target": f">= {VERIFY_VS_NOVERIFY:.2f}x",
                             "verdict": "PASS" if vn["min"] >= VERIFY_VS_NOVERIFY else "FAIL"})
            va = s["load"].get("vs_again")
            if va:  # identical loads: the spread the verify-off comparison cannot resolve
                worst = min(va["min"], 1 / va["max"])
                rows.append({"contender": c["name"], "op": "load", "baseline": "fp_dcp[again]",
                             "vs": "the same verified load again (back to back; worst round)",
                             "ratio": worst, "value": f"{worst:.2f}x ({va['min']:.2f}-{va['max']:.2f})",
                             "target": "", "verdict": ""})
            add("save", "torch_checkpointing", s["save"]["median"], peer["save"], "torch_checkpointing", 1.0)
            add("load", "torch_checkpointing", s["load"]["median"], peer["load"], "torch_checkpointing", 1.0)
        for op in ("save", "load"):
            ov = s[op]["rss_overhead_max_bytes"]
            rows.append({"contender": c["name"], "op": op, "vs": "peak RSS overhead",
                         "baseline": "", "ratio": None,
                         "value": f"{ov / C.MiB:.0f} MiB" if ov is not None else "-",
                         "target": f"<= {RSS_OVERHEAD_MAX // C.MiB} MiB",
                         "verdict": ("" if not targets else "n/a" if ov is None
                                     else "PASS" if ov <= RSS_OVERHEAD_MAX else "FAIL")})
    return rows


def print_report(mix_result: dict, summ: dict, ratios: list[dict], contenders: list[dict]) -> str:
    lines = [f"mix {mix_result['mix']}: {mix_result['tensors']} tensors, {mix_result['objects']} "
             f"non-tensor items, {C.fmt_size(mix_result['payload_bytes'])} payload"]
    rows = []
    for c in contenders:
        for op in ("save", "load"):
            s = summ[c["name"]][op]
            status = "ok"
            if s["failed"]:
                status = f"FAILED {s['failed']}/{s['failed'] + s['n']}"
            elif c["kind"] not in ("raw", "dcp_floor") and op == "load":
                status = "verified" + ("" if s["cold"] else " WARM")
            rows.append([c["name"], op, C.fmt_num(s["median"]), C.fmt_num(s["min"]),
                         C.fmt_num(s["max"]), s["n"],
                         "-" if s["rss_base_bytes"] is None or c["kind"] == "raw"
                         else f"{s['rss_base_bytes'] / C.MiB:.0f}",
                         "-" if s["rss_overhead_max_bytes"] is None or c["kind"] == "raw"
                         else f"{s['rss_overhead_max_bytes'] / C.MiB:.0f}",
                         status])
    lines.append(C.format_table(["contender", "op", "GB/s med", "min", "max", "n",
                                 "RSS base MiB", "peak over MiB", "status"], rows))
    notes = {summ[c["name"]][op]["note"] for c in contenders if c["kind"] == "raw"
             for op in ("save", "load") if summ[c["name"]][op]["note"]}
    for n in sorted(notes):
        lines.append(f"  raw: {n}")
    for c in contenders:
        for op in ("save", "load"):
            e = summ[c["name"]][op]["first_error"]
            if e:
                lines.append(f"  {c['name']} {op} error: {_short(e)}")
    if ratios:
        lines.append("")
        rrows = [[r["contender"], r["op"], r["vs"] + (f" ({r['baseline']})" if r["baseline"] else ""),
                  r.get("value") or (f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"),
                  r["target"], r["verdict"]] for r in ratios]
        lines.append(C.format_table(["contender", "op", "vs", "ratio", "target", "verdict"], rrows))
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    return text


def parse_args(argv=None):
    p = C.parser(
        "Save and cold-load throughput of fp_dcp vs stock DCP FileSystemWriter/Reader, "
        "torch.save/torch.load and the raw device. Each run is a fresh subprocess; "
        "loads are verified bit-exact; contenders alternate across rounds.", "save_load",
        size="4GiB", size_help="tensor payload of the generated state dict (e.g. 4GiB, 512MiB)",
        quick="smoke test: --size 256MiB --repeat 1 (overrides both)",
        seed="seed of the generated state dict", child_timeout=1800,
        keep="keep the checkpoints (in --dir) afterwards", profiles="bare,throttled",
        dir_help=f"target directory (default {C.DEFAULT_DIR}); needs 3x --size free")
    p.add_argument("--mix", choices=("large", "small", "both"), default="both",
                   help="large: 32-64 big float32/bfloat16 tensors; small: thousands of 1 KiB-4 MiB "
                        "tensors of mixed dtypes/shapes (incl. 0-d) plus non-tensor items; both: each")
    p.add_argument("--repeat", type=int, default=3, help="rounds; contenders alternate within a round")
    p.add_argument("--contenders", default="fp_dcp,stock,torch_checkpointing,torch.save,raw",
                   help="comma list from: fp_dcp, stock, torch_checkpointing, torch.save, raw, dcp_floor, "
                        "dcp_floor_fp, fp_dcp_thp, fp_dcp_recycle "
                        "(torch_checkpointing: pip install -e '.[bench]'; skipped with a message if missing; "
                        "dcp_floor: dcp.save/dcp.load through a storage that moves no bytes, DCP's own "
                        "time, which gives the best ratio to raw any storage can reach here; dcp_floor_fp: the "
                        "same with fp_dcp's planners; fp_dcp_thp: fp_dcp with the state dict allocated "
                        "under THP_MEM_ALLOC_ENABLE=1, torch's page-aligned huge-page allocation; "
                        "fp_dcp_recycle: fp_dcp recycling its checkpoint of the round before, with "
                        "raw[hugebuf,rewrite] beside it when raw is asked for)")
    p.add_argument("--planners", choices=("dcp", "fp"), default="dcp",
                   help="the planners of the fp_dcp contenders: dcp (DCP's default planners, what a job "
                        "gets without planner=) or fp (FastPersistSavePlanner / FastPersistLoadPlanner)")
    p.add_argument("--no-verify-row", action="store_true",
                   help="leave out fp_dcp[noverify] (the default reader with verify_checksums=False, "
                        "run in the same rounds to show the verifier's cost)")
    p.add_argument("--again-row", action="store_true",
                   help="add fp_dcp[again]: the same verified reader loading fp_dcp's checkpoint a second "
                        "time in each round, back to back with the others: the round-to-round spread of "
                        "identical loads, against which the verify-off row's 5 %% bound can be read")
    p.add_argument("--engines", default="",
                   help="also run fp_dcp with FastPersistOptions(engine=E) for each E (e.g. aio,uring,threads)")
    p.add_argument("--read-threads", default="",
                   help="also run fp_dcp with FastPersistOptions(read_threads=N) for each N (e.g. 1,2): "
                        "the default reader's engines of long runs against one")
    p.add_argument("--stock-threads", type=int, default=4,
                   help="thread_count of the tuned stock FileSystemWriter (1 or 0: no tuned contender)")
    p.add_argument("--raw", choices=("auto", "fio", "python"), default="auto",
                   help="raw device method: fio (O_DIRECT libaio) if on PATH, else a single-request "
                        "O_DIRECT loop in Python")
    p.add_argument("--raw-bs", default="1M,4M,16M",
                   help="raw block sizes (one fio contender each, plus raw[hugebuf]; the raw reference "
                        "of every ratio is the fastest of them in the same run)")
    p.add_argument("--raw-iodepth", type=int, default=16, help="fio iodepth of the one-job raw contenders")
    p.add_argument("--raw-jobs", default="4x32",
                   help="more fio shapes per --raw-bs, JOBSxDEPTH each (every job writes / reads its own slice "
                        "of one file): several submitters, the device's best at a deep queue ('' for none)")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache before each run (loads are then WARM)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.repeat = "256MiB", 1
    args.size_bytes = parse_size(args.size)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    bad = set(args.contenders.split(",")) - {"fp_dcp", "stock", "torch_checkpointing", "torch.save", "raw",
                                             "dcp_floor", "dcp_floor_fp", "fp_dcp_thp", "fp_dcp_recycle"}
    if bad:
        p.error(f"unknown contenders {sorted(bad)}: choose from fp_dcp, stock, torch_checkpointing, "
                f"torch.save, raw, dcp_floor, dcp_floor_fp, fp_dcp_thp, fp_dcp_recycle")
    C.check_profiles(p, args.profiles)
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    with C.Bench("save_load", args) as bench:
        workdir = bench.make_workdir(3 * args.size_bytes)
        return _run(args, bench, workdir)


def _run(args, bench: C.Bench, workdir: Path) -> int:
    can_drop = False
    if args.no_drop_caches:
        print("warning: --no-drop-caches: loads are WARM (page cache not dropped)")
    else:
        can_drop, why = C.drop_caches()
        if not can_drop:
            print(f"warning: {why}")

    fp_ok, fp_info = False, "not requested"
    if set(args.contenders.split(",")) & {"fp_dcp", "fp_dcp_thp", "fp_dcp_recycle", "dcp_floor_fp"}:
        probe = C.run_child(SCRIPT, {"kind": "probe", "op": "probe"}, timeout_s=300)
        fp_ok = bool(probe.get("ok"))
        fp_info = (f"fp_dcp {probe.get('version')} from {probe.get('file')}" if fp_ok
                   else probe.get("error"))
        if fp_ok:
            print(f"using {fp_info}")
        if not fp_ok:
            print(f"SKIPPING fp_dcp contenders: cannot import FastPersistWriter/Reader/Options "
                  f"from fp_dcp ({fp_info})")
    if "torch_checkpointing" in args.contenders.split(","):
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError as e:
            print(f"SKIPPING torch_checkpointing: {e} (pip install -e '.[bench]')")
            args.contenders = ",".join(c for c in args.contenders.split(",") if c != "torch_checkpointing")
    raw_method = args.raw if args.raw != "auto" else ("fio" if C.fio_path() else "python")
    if args.raw == "fio" and not C.fio_path():
        sys.exit("error: --raw fio but fio is not on PATH")
    contenders = build_contenders(args, fp_ok, raw_method)
    if not contenders:
        sys.exit("error: no contender left to run")

    hw = bench.hardware()
    print(f"raw device method: {raw_method}"
          + ("" if raw_method == "fio" else
             (" (fio not on PATH)" if not C.fio_path() else "")
             + ": single-request Python O_DIRECT baseline, below the device's queued bandwidth"))
    print(f"contenders: {', '.join(c['name'] for c in contenders)}; loads "
          f"{'cold (page cache dropped before each run)' if can_drop else 'WARM'}")

    mixes = ["large", "small"] if args.mix == "both" else [args.mix]
    # (a ram profile's file system holds what --dir must: 3x --size, and room for ext4's own)
    profiles = [C.DeviceProfile(name, bench.target, args.throttle_iops, fs_bytes=3 * args.size_bytes + C.GiB,
                                run_bytes=args.size_bytes) for name in args.profiles.split(",")]
    report = bench.report(size_bytes=args.size_bytes, repeat=args.repeat, seed=args.seed,
                          hardware=hw, raw_method=raw_method, cold_loads=can_drop,
                          fp_dcp={"available": fp_ok, "info": fp_info},
                          contenders=contenders, mixes=[])
    texts: list[str] = []
    for prof in C.entered(profiles, texts):
        print(f"\n==== device profile: {prof.label()} ====", flush=True)
        for mix in mixes:
            res = run_mix(args, mix, contenders, prof.directory or workdir, can_drop)
            summ = _summaries(res, contenders)
            ratios = _ratios(mix, summ, contenders)
            texts.append(f"device profile: {prof.label()}\n"
                         + print_report(res, summ, ratios, contenders))
            report["mixes"].append({**res, "profile": prof.name, "summary": summ, "ratios": ratios})
    report["profiles"] = [p.describe() for p in profiles]  # as entered (a ram profile's loop device named)
    if not fp_ok and "fp_dcp" in args.contenders.split(","):
        print(f"\nfp_dcp was SKIPPED ({fp_info}): no ratios or targets evaluated.")
    report["table"] = "\n\n".join(["\n".join(C.hardware_lines(hw))] + texts)
    bench.write(report)
    failed = any(s[op]["failed"] for m in report["mixes"] for s in m["summary"].values()
                 for op in ("save", "load"))
    return 1 if failed else 0


def main(argv=None) -> int:
    return C.main(child_main, run, argv)


if __name__ == "__main__":
    sys.exit(main())
