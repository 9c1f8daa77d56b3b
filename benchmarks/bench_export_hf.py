#!/usr/bin/env python
"""Export to Hugging Face's layout: fp_dcp.export_hf vs the raw device and DCP's own consolidation.

One state dict (``--size``, the ``large`` mix of bench_save_load: 2-d float32
and bfloat16 tensors) is saved by 4 ranks (gloo, each tensor a ``Shard(0)``
DTensor) twice: with FastPersistWriter, and with DCP's
``HuggingFaceStorageWriter(save_distributed=True)`` (each rank's safetensors
files, what DCP's consolidation reads).  Then, each in a fresh process after
dropping the page cache (where allowed), timed around the call alone:

* ``export_hf``: one process, O_DIRECT (the default) and through the page
  cache (``direct_io=False``); and 4 ranks, each writing its share;
* DCP: ``consolidate_safetensors_files`` (one process) and
  ``consolidate_safetensors_files_on_every_rank`` (4 ranks) with the same
  split into files, each followed by an fsync of the files it wrote (it
  syncs none; export_hf syncs every file): the JSON keeps both parts;
* the raw device, before and after (the ratios use the faster): a
  sequential O_DIRECT write of the same bytes (fio where installed, else
  fp_dcp's engine into one huge-page buffer), a read of it, and a copy (a
  read of one file and a write of another at once through fp_dcp's engine).
  An export reads every byte and writes it again on the same device, so the
  raw copy (the faster of at once, or read then write) is what it can reach.

Each child imports what it runs before its clock starts (after a dropped
page cache, importing torch.distributed.checkpoint alone takes seconds); the
import time is recorded apart.  Rates are output bytes (shards and index) /
seconds.  Every output is read
back with ``safetensors`` and compared bit for bit with the state dict
before its numbers count.  Targets: export_hf at >= 0.8x the raw write, and at
>= 0.8x the raw copy.

    flock /tmp/fp_dcp_bench.lock python benchmarks/bench_export_hf.py --size 2GiB
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from fp_dcp.options import parse_size  # noqa: E402

SCRIPT = Path(__file__).resolve()
WORLD = 4
TARGET = 0.8


# ---------------------------------------------------------------- children


def _local_state(spec: C.StateDictSpec, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for t in spec.tensors:
        full = C.StateDictFactory(C.StateDictSpec(spec.mix, spec.seed, [t], {})).build()[t.key]
        local = Shard(0)._split_tensor(full, world, with_padding=False)[0][rank].clone()
        sd[t.key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                       stride=full.stride())
        del full
    return sd


def _in_group(cfg: dict, fn):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['init_file']}", rank=cfg["rank"],
                            world_size=cfg["world"])
    try:
        return fn(dist)
    finally:
        dist.destroy_process_group()


def child_save(cfg: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    fp_dcp = C.import_fp_dcp()
    spec = C.StateDictSpec.from_json(cfg["spec"])

    def run(dist):
        sd = _local_state(spec, cfg["rank"], cfg["world"])
        out = {"ok": True}
        for name, writer in (("fp_dcp", fp_dcp.FastPersistWriter(cfg["fp_dcp"])),
                             ("hf_sharded", HuggingFaceStorageWriter(cfg["hf_sharded"], save_distributed=True))):
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer)
            dist.barrier()
            out[name + "_seconds"] = time.perf_counter() - t0
        return out

    return _in_group(cfg, run)


def _warm_imports() -> float:
    """Import what export_hf imports on its first call, outside the clock, as
    the DCP rows import their module before theirs: after the page cache is
    dropped, importing torch.distributed.checkpoint takes seconds on this
    disk, which would count against whichever row pays it."""
    t0 = time.perf_counter()
    import numpy  # noqa: F401
    import torch.distributed.checkpoint.default_planner  # noqa: F401
    import torch.distributed.checkpoint.state_dict_loader  # noqa: F401

    import fp_dcp.engine  # noqa: F401
    import fp_dcp.load.reader  # noqa: F401
    import fp_dcp.load.stock  # noqa: F401
    import fp_dcp.tools.export_hf  # noqa: F401
    return time.perf_counter() - t0


def child_export(cfg: dict) -> dict:
    fp_dcp = C.import_fp_dcp()
    imports = _warm_imports()
    kw = dict(max_shard_size=cfg["max_shard_size"], direct_io=cfg["direct_io"])
    if cfg.get("world", 1) == 1:
        t0 = time.perf_counter()
        r = fp_dcp.export_hf(cfg["src"], cfg["out"], **kw)
        return {"ok": True, "seconds": time.perf_counter() - t0, "direct": r["direct"], "import_seconds": imports}

    def run(dist):
        dist.barrier()
        t0 = time.perf_counter()
        r = fp_dcp.export_hf(cfg["src"], cfg["out"], process_group=dist.group.WORLD, **kw)
        return {"ok": True, "seconds": time.perf_counter() - t0, "direct": r["direct"], "written": r["written"],
                "import_seconds": imports}

    return _in_group(cfg, run)


def _fsync_all(directory: str) -> float:
    """Seconds to fsync every file DCP's consolidation wrote (it syncs none;
    export_hf syncs each file, so both are timed to durable bytes)."""
    t0 = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def child_consolidate(cfg: dict) -> dict:
    t0 = time.perf_counter()
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as hf

    imports = time.perf_counter() - t0
    os.makedirs(cfg["out"], exist_ok=True)
    mapping = cfg["mapping"]
    if cfg.get("world", 1) == 1:
        t0 = time.perf_counter()
        hf.consolidate_safetensors_files(cfg["src"], cfg["out"], mapping, num_threads=cfg["threads"])
        call = time.perf_counter() - t0
        sync = _fsync_all(cfg["out"])
        return {"ok": True, "seconds": call + sync, "call_seconds": call, "sync_seconds": sync,
                "import_seconds": imports}

    def run(dist):
        dist.barrier()
        t0 = time.perf_counter()
        hf.consolidate_safetensors_files_on_every_rank(cfg["src"], cfg["out"], mapping, num_threads=cfg["threads"],
                                                       process_group=dist.group.WORLD)
        dist.barrier()
        call = time.perf_counter() - t0
        sync = _fsync_all(cfg["out"]) if cfg["rank"] == 0 else 0.0
        dist.barrier()
        return {"ok": True, "seconds": time.perf_counter() - t0, "call_seconds": call, "sync_seconds": sync,
                "import_seconds": imports}

    return _in_group(cfg, run)


def child_verify(cfg: dict) -> dict:
    """Read every safetensors file of ``out`` back and compare with the spec."""
    from safetensors.torch import load_file

    spec = C.StateDictSpec.from_json(cfg["spec"])
    sd: dict = {}
    for name in sorted(os.listdir(cfg["out"])):
        if name.endswith(".safetensors"):
            part = load_file(os.path.join(cfg["out"], name))
            dup = set(part) & set(sd)
            if dup:
                return {"ok": False, "error": f"{sorted(dup)[:3]} in two files"}
            sd.update(part)
    spec.objects = {}
    errors = C.StateDictFactory(spec).verify(sd)
    extra = set(sd) - {t.key for t in spec.tensors}
    if extra:
        errors.append(f"tensors not in the state dict: {sorted(extra)[:3]}")
    return {"ok": not errors, "errors": errors}


def _raw_copy(src: Path, dst: Path, nbytes: int) -> dict:
    """The device copying ``nbytes``: a sequential O_DIRECT read of ``src``
    and write of ``dst`` at once (fp_dcp's engine, 4 MiB requests, queue
    depth 16, each into its own huge-page buffer; the write fsynced), as an
    export reads its source while it writes.  Seconds: until both are done."""
    from fp_dcp.tools.tune import engine_pass

    out: dict = {}

    def one(op: str, path: Path) -> None:
        try:
            out[op] = engine_pass(op, str(path), nbytes, 4 * C.MiB, 16, kind="aio")
        except Exception as e:  # noqa: BLE001 - raised below
            out[op] = e

    threads = [threading.Thread(target=one, args=a) for a in (("read", src), ("write", dst))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for r in out.values():
        if isinstance(r, Exception):
            raise r
    return {"bytes": nbytes, "seconds": seconds, "read_seconds": out["read"]["seconds"],
            "write_seconds": out["write"]["seconds"],
            "note": "read of one file and write of another at once, fp_dcp._aio engine O_DIRECT, huge-page "
                    "buffers, bs=4 MiB qd=16 each, + fsync"}


def child_load(cfg: dict) -> dict:
    """dcp.load of the checkpoint through FastPersistReader into preallocated
    whole tensors, one process: the export's read alone, for reference."""
    import torch
    import torch.distributed.checkpoint as dcp

    fp_dcp = C.import_fp_dcp()
    md = fp_dcp.FastPersistReader(cfg["src"]).read_metadata()
    sd = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if hasattr(v, "chunks")}
    C.drop_caches()  # the metadata read above
    t0 = time.perf_counter()
    dcp.load(sd, storage_reader=fp_dcp.FastPersistReader(cfg["src"]), no_dist=True)
    seconds = time.perf_counter() - t0
    return {"ok": True, "seconds": seconds, "bytes": sum(t.nbytes for t in sd.values())}


def child_raw(cfg: dict) -> dict:
    """The device alone: a sequential write, a read of what it wrote, and a
    copy (read and write at once), the page cache dropped before each."""
    path, other = Path(cfg["dir"]) / "raw.bin", Path(cfg["dir"]) / "raw-copy.bin"
    try:
        write = C.raw_device_io("write", path, cfg["bytes"], method=cfg["method"])
        C.drop_caches()
        read = C.raw_device_io("read", path, cfg["bytes"], method=cfg["method"])
        C.drop_caches()
        copy = _raw_copy(path, other, write["bytes"])
        return {"ok": True, **write, "read": read, "copy": copy}
    finally:
        path.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


CHILDREN = {"save": child_save, "export": child_export, "consolidate": child_consolidate, "verify": child_verify,
            "raw": child_raw, "load": child_load}


def child_main(arg: str) -> None:
    cfg = json.loads(arg)
    try:
        result = CHILDREN[cfg["kind"]](cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    C.emit_result(result)


# ---------------------------------------------------------------- parent


def _ranks(cfg: dict, world: int, workdir: Path, timeout: float) -> dict:
    """``cfg`` on ``world`` rank processes at once; the slowest rank's result."""
    init = workdir / f"rendezvous-{time.monotonic_ns()}"
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        results = list(pool.map(lambda r: C.run_child(SCRIPT, dict(cfg, rank=r, world=world, init_file=str(init)),
                                                      timeout_s=timeout), range(world)))
    init.unlink(missing_ok=True)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        return bad[0]
    slowest = max(results, key=lambda r: r.get("seconds", 0))
    merged = dict(slowest, ranks=results)
    if any("sync_seconds" in r for r in results):  # one rank syncs the files of all
        merged["sync_seconds"] = max(r.get("sync_seconds", 0.0) for r in results)
    return merged


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _timed(label: str, run, out: Path, spec_json: dict, args) -> dict:
    cold, why = C.drop_caches()
    r = run()
    r["cold"] = cold
    if r.get("ok"):
        r["bytes"] = _dir_bytes(out)
        r["gbps"] = r["bytes"] / r["seconds"] / 1e9
        v = C.run_child(SCRIPT, {"kind": "verify", "out": str(out), "spec": spec_json}, timeout_s=args.child_timeout)
        r["verified"] = bool(v.get("ok"))
        if not v.get("ok"):
            r["verify_errors"] = v.get("errors") or v.get("error")
    print(f"{label}: {C.fmt_num(r.get('gbps'))} GB/s in {C.fmt_num(r.get('seconds'))} s"
          + ("" if r.get("ok") else f" FAILED {r.get('error')}") + ("" if cold else f" ({why})"), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return r


def _raw(args, workdir: Path) -> dict:
    r = C.run_child(SCRIPT, {"kind": "raw", "dir": str(workdir), "bytes": args.size_bytes,
                             "method": args.raw_method}, timeout_s=args.child_timeout)
    if r.get("ok"):
        r["gbps"] = r["bytes"] / r["seconds"] / 1e9
        r["read_gbps"] = r["read"]["bytes"] / r["read"]["seconds"] / 1e9
        copy = r["copy"]
        # an export reads every byte and writes it again: at best the faster of the
        # device reading and writing at once, or one after the other
        r["copy_gbps"] = max(copy["bytes"] / copy["seconds"], 1 / (1 / r["gbps"] + 1 / r["read_gbps"]) * 1e9) / 1e9
        print(f"raw write {C.fmt_num(r['gbps'])} GB/s, read {C.fmt_num(r['read_gbps'])} GB/s, copy "
              f"{C.fmt_num(r['copy_gbps'])} GB/s ({r['note']})", flush=True)
    else:
        print(f"raw: FAILED {r.get('error')}", flush=True)
    return r


def _run(args, bench: C.Bench) -> int:
    import torch

    from fp_dcp.tools.export_hf import plan_export

    hw = bench.hardware()
    workdir = bench.make_workdir(5 * args.size_bytes)
    spec = C.make_spec("large", args.size_bytes, args.seed)
    spec_json = spec.to_json()
    plan = plan_export([(t.key, getattr(torch, t.dtype), t.shape) for t in spec.tensors],
                       max_shard_size=args.max_shard_size)
    mapping = {t.name: i + 1 for i, f in enumerate(plan.files) for t in f.tensors}
    print(f"state dict {C.fmt_size(spec.payload_bytes)} in {len(spec.tensors)} tensors, saved by {WORLD} ranks; "
          f"{len(plan.files)} output files of at most {args.max_shard_size}", flush=True)
    ckpt, sharded = workdir / "fp_dcp", workdir / "hf_sharded"
    saved = _ranks({"kind": "save", "spec": spec_json, "fp_dcp": str(ckpt), "hf_sharded": str(sharded)}, WORLD,
                   workdir, args.child_timeout)
    if not saved.get("ok"):
        print(f"saving FAILED: {saved.get('error')}\n{saved.get('trace', '')}")
        return 1
    raws = [_raw(args, workdir)]
    load = C.run_child(SCRIPT, {"kind": "load", "src": str(ckpt)}, timeout_s=args.child_timeout)
    if load.get("ok"):
        load["gbps"] = load["bytes"] / load["seconds"] / 1e9
    print(f"dcp.load through FastPersistReader (the export's read alone): {C.fmt_num(load.get('gbps'))} GB/s"
          + ("" if load.get("ok") else f" FAILED {load.get('error')}"), flush=True)
    out = workdir / "out"
    ex = {"src": str(ckpt), "out": str(out), "max_shard_size": args.max_shard_size, "kind": "export"}
    runs = {
        "export_hf, 1 process": lambda: C.run_child(SCRIPT, dict(ex, direct_io=None), timeout_s=args.child_timeout),
        "export_hf, 1 process, page cache": lambda: C.run_child(SCRIPT, dict(ex, direct_io=False),
                                                                timeout_s=args.child_timeout),
        f"export_hf, {WORLD} ranks": lambda: _ranks(dict(ex, direct_io=None), WORLD, workdir, args.child_timeout),
        "DCP consolidate_safetensors_files + fsync": lambda: C.run_child(
            SCRIPT, {"kind": "consolidate", "src": str(sharded), "out": str(out), "mapping": mapping,
                     "threads": args.dcp_threads}, timeout_s=args.child_timeout),
        f"DCP consolidate_safetensors_files_on_every_rank + fsync, {WORLD} ranks": lambda: _ranks(
            {"kind": "consolidate", "src": str(sharded), "out": str(out), "mapping": mapping,
             "threads": args.dcp_threads}, WORLD, workdir, args.child_timeout),
    }
    results = {}
    for _ in range(args.repeat):
        for label, run in runs.items():
            results.setdefault(label, []).append(_timed(label, run, out, spec_json, args))
    raws.append(_raw(args, workdir))
    good_raws = [r for r in raws if r.get("ok")]
    raw = max((r["gbps"] for r in good_raws), default=None)
    raw_read = max((r["read_gbps"] for r in good_raws), default=None)
    raw_copy = max((r["copy_gbps"] for r in good_raws), default=None)
    rows, targets = [], []
    for label, rs in results.items():
        good = [r for r in rs if r.get("ok") and r.get("verified")]
        best = max(good, key=lambda r: r["gbps"]) if good else None
        g = best and best["gbps"]
        rows.append([label, C.fmt_num(best and best["seconds"]), C.fmt_num(g), C.fmt_num(g and raw and g / raw),
                     C.fmt_num(g and raw_copy and g / raw_copy), C.fmt_num(best and best.get("sync_seconds")),
                     C.fmt_num(best and best.get("import_seconds")), f"{len(good)}/{len(rs)}"])
    ours = [results[k] for k in results if k.startswith("export_hf") and "page cache" not in k]
    best_ours = max((r["gbps"] for rs in ours for r in rs if r.get("ok") and r.get("verified")), default=None)
    for what, ref in (("raw write", raw), ("raw copy (read + write of the same bytes)", raw_copy)):
        ratio = best_ours / ref if best_ours and ref else None
        targets.append({"target": f"export_hf >= {TARGET}x {what}", "value": C.fmt_num(ratio),
                        "beside": f"{C.fmt_num(ref)} GB/s",
                        "verdict": "-" if ratio is None else "PASS" if ratio >= TARGET else "MISS"})
    lines = C.hardware_lines(hw) + [
        "", f"state dict {C.fmt_size(spec.payload_bytes)}, {len(spec.tensors)} tensors, saved by {WORLD} ranks "
            f"(fp_dcp {C.fmt_num(saved['fp_dcp_seconds'])} s, HuggingFaceStorageWriter "
            f"{C.fmt_num(saved['hf_sharded_seconds'])} s); {len(plan.files)} output files "
            f"(--max-shard-size {args.max_shard_size}); best of {args.repeat}; page cache dropped before each: "
            f"{all(r.get('cold') for rs in results.values() for r in rs)}",
        f"raw device (best of before and after): write {C.fmt_num(raw)} GB/s ({raws[0].get('note', '')}), "
        f"read {C.fmt_num(raw_read)} GB/s, copy {C.fmt_num(raw_copy)} GB/s (the faster of: read and write at "
        f"once, {good_raws[0]['copy']['note'] if good_raws else '-'}; or one after the other)",
        f"dcp.load of the fp_dcp checkpoint through FastPersistReader into whole tensors, 1 process (the "
        f"export's read alone): {C.fmt_num(load.get('gbps'))} GB/s in {C.fmt_num(load.get('seconds'))} s",
        "", C.format_table(["export", "seconds", "GB/s", "vs raw write", "vs raw copy", "of which fsync s",
                            "imports s (not timed)", "verified"], rows),
        "", C.format_table(["target", "value", "beside", "verdict"],
                           [[t["target"], t["value"], t["beside"], t["verdict"]] for t in targets])]
    text = "\n".join(lines)
    print("\n" + text)
    report = bench.report(size_bytes=args.size_bytes, seed=args.seed, hardware=hw, world=WORLD,
                          max_shard_size=args.max_shard_size, files=len(plan.files), save=saved, raw=raws, load=load,
                          results=results, targets=targets, table=text)
    bench.write(report)
    return 1 if any(not r.get("ok") or not r.get("verified") for rs in results.values() for r in rs) else 0


def parse_args(argv=None):
    p = C.parser("fp_dcp.export_hf of a checkpoint saved by 4 ranks, against the raw device's O_DIRECT write and "
                 "DCP's consolidation (consolidate_safetensors_files) of the same state. Run under "
                 "`flock /tmp/fp_dcp_bench.lock` (the disk is shared).", "export_hf",
                 size="2GiB", size_help="tensor payload of the state dict", seed="seed of the generated state dict",
                 child_timeout=1200, keep="keep the work directory")
    p.add_argument("--max-shard-size", default="500MB", help="export_hf's max_shard_size (Hugging Face units)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the contenders")
    p.add_argument("--dcp-threads", type=int, default=1, help="num_threads of DCP's consolidation")
    p.add_argument("--raw-method", default="fio" if C.fio_path() else "hugebuf",
                   help="raw write: fio, hugebuf (fp_dcp's engine, huge-page buffer) or python")
    args = p.parse_args(argv)
    args.size_bytes = parse_size(args.size)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    with C.Bench("export_hf", args) as bench:
        return _run(args, bench)


def main(argv=None) -> int:
    return C.main(child_main, run, argv)


if __name__ == "__main__":
    sys.exit(main())
