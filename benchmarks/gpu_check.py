#!/usr/bin/env python3
"""The GPU check: one command for a machine with one NVIDIA GPU and a
preinstalled torch, nothing downloadable (docs/GPU.md says how to run it).

    python benchmarks/gpu_check.py --out DIR          # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --out DIR  # anywhere: CPU tensors, small sizes

Steps, each guarded (a failing step is recorded and the others still run):
build the extension in place (no download, no build isolation), run the
tests that touch CUDA, then for a model+optimizer state dict (``--big-gib``)
and one of ``--small-count`` small tensors: torch's own pinned-memory
``copy_`` of the same bytes (the D2H / H2D ceiling), save, eager async save
(the time the caller is blocked), lazy async save (the time to
``staging_completion`` and the slowdown of a training step running beside
it), load, each checked bit-exact, and the stock ``FileSystemWriter`` /
``FileSystemReader``; then the disk itself (fp_dcp's engine, and fio when
present).  One table is printed; ``DIR/gpu_check.json`` holds every figure
(rewritten after each step)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's fp_dcp (built in place), installed or not
    sys.path.insert(0, str(ROOT))
MiB, GiB = 1 << 20, 1 << 30
TEST_SELECTION = "gpu or cuda or nccl"  # markers and names of the tests that touch CUDA


def test_files() -> list[str]:
    """The test files that mention CUDA (where every CUDA test lives)."""
    return sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                  if "cuda" in p.read_text(errors="replace"))


# ---------------------------------------------------------------- the build


def _ext_table() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with open(ROOT / "pyproject.toml", "rb") as f:
        (ext,) = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    return ext


def _built_path(name: str) -> Path:
    import sysconfig

    return ROOT.joinpath(*name.split(".")).with_suffix("").parent / (
        name.rsplit(".", 1)[-1] + sysconfig.get_config_var("EXT_SUFFIX"))


def build_extension() -> dict:
    """Build the extension in place from pyproject.toml's table with the
    setuptools and Cython already installed (no download, no isolation, any
    setuptools release); nothing to do when the build is newer than every
    source."""
    ext = _ext_table()
    out = _built_path(ext["name"])
    inputs = [ROOT / p for p in ext["sources"] + ext.get("depends", [])] + [ROOT / "pyproject.toml"]
    if out.exists() and all(p.stat().st_mtime <= out.stat().st_mtime for p in inputs):
        return {"built": False, "note": f"{out.name} is newer than its sources", "path": str(out)}
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        extension = Extension(ext["name"], ext["sources"], include_dirs=ext.get("include-dirs", []),
                              depends=ext.get("depends", []), extra_compile_args=ext.get("extra-compile-args", []),
                              extra_link_args=ext.get("extra-link-args", []))
        mods = cythonize([extension], quiet=True, build_dir="build/gpu_check", compiler_directives={"language_level": 3})
        dist = Distribution({"name": "fp-dcp", "ext_modules": mods})
        cmd = dist.get_command_obj("build_ext")
        cmd.inplace = True
        cmd.parallel = os.cpu_count() or 1
        dist.run_command("build_ext")
    finally:
        os.chdir(cwd)
    return {"built": True, "seconds": time.perf_counter() - t0, "path": str(out)}


def run_tests(mode: str, timeout_s: float) -> dict:
    """The tests that touch CUDA (``-m gpu`` and the CUDA ones by name), in a
    child pytest: ``run`` runs them, ``collect`` only collects them (the dry
    run: the selection is not empty and imports)."""
    if mode == "none":
        return {"mode": "none"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", TEST_SELECTION, *test_files()]
    if mode == "collect":
        cmd.append("--collect-only")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                       stdin=subprocess.DEVNULL)
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else p.stderr.strip()[-300:]
    result = {"mode": mode, "command": " ".join(cmd), "returncode": p.returncode, "summary": summary,
              "seconds": time.perf_counter() - t0}
    if p.returncode != 0:
        result["output_tail"] = (p.stdout + p.stderr)[-6000:]
        raise StepFailed(f"pytest exited {p.returncode}: {summary}", result)
    return result


class StepFailed(Exception):
    def __init__(self, message: str, detail: dict) -> None:
        super().__init__(message)
        self.detail = detail


# ------------------------------------------------------------- state dicts


def big_state_dict(total: int, tensor_bytes: int, device: str) -> dict:
    """A model's parameters and its Adam state (exp_avg, exp_avg_sq), fp32,
    ``total`` bytes in tensors of ``tensor_bytes``."""
    import torch

    n = tensor_bytes // 4
    layers = max(1, -(-total // (3 * tensor_bytes)))
    g = torch.Generator(device=device).manual_seed(1)
    model = {f"layers.{i}.weight": torch.randn(n, device=device, generator=g) for i in range(layers)}
    state = {i: {"step": torch.tensor(float(i + 1)), "exp_avg": torch.randn(n, device=device, generator=g),
                 "exp_avg_sq": torch.rand(n, device=device, generator=g)} for i in range(layers)}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(layers))}]}}


def small_state_dict(count: int, device: str) -> dict:
    """``count`` small tensors of mixed sizes and dtypes (a model of many
    norms, biases and small projections)."""
    import torch

    g = torch.Generator(device=device).manual_seed(2)
    shapes = [(64,), (256,), (1024,), (64, 64), (128, 96), (4096,), (3, 3, 32, 32)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    sd = {}
    for i in range(count):
        shape, dtype = shapes[i % len(shapes)], dtypes[(i // len(shapes)) % len(dtypes)]
        t = torch.randn(shape, device=device, generator=g)
        sd[f"blocks.{i // 8}.p{i % 8}"] = t.to(dtype) if dtype != torch.int64 else (t * 1000).to(dtype)
    return sd


def tensors(sd: Any) -> Iterator[Any]:
    import torch

    if isinstance(sd, torch.Tensor):
        yield sd
    elif isinstance(sd, dict):
        for v in sd.values():
            yield from tensors(v)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            yield from tensors(v)


def nbytes(sd: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(sd))


def zeros_like(sd: Any) -> Any:
    import torch

    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    return sd


def mismatches(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``b`` is not bit-exact ``a`` (names, at most a few)."""
    import torch

    if isinstance(a, torch.Tensor):
        same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [path]
    if isinstance(a, dict):
        out: list[str] = []
        for k, v in a.items():
            out += mismatches(v, b.get(k) if isinstance(b, dict) else None, f"{path}.{k}" if path else str(k))
        return out[:5]
    return [] if a == b else [path]


# ------------------------------------------------------------------ timing


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def copy_ceiling(sd: Any, device: str, repeats: int = 2) -> dict:
    """torch's own copy of the same bytes into / out of one pinned host
    buffer (``copy_(non_blocking=True)`` per tensor): the D2H / H2D ceiling
    of any save or load.  On the CPU (dry run) an ordinary buffer."""
    import torch

    ts = list(tensors(sd))
    total = nbytes(sd)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")
    views, off = [], 0
    for t in ts:
        n = t.numel() * t.element_size()
        views.append(host[off:off + n])
        off += n
    flat = [t.contiguous().view(-1).view(torch.uint8) for t in ts]
    best = {"d2h_s": float("inf"), "h2d_s": float("inf")}
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for v, f in zip(views, flat):
            v.copy_(f, non_blocking=True)
        sync(device)
        t1 = time.perf_counter()
        for v, f in zip(views, flat):
            f.copy_(v, non_blocking=True)
        sync(device)
        t2 = time.perf_counter()
        best = {"d2h_s": min(best["d2h_s"], t1 - t0), "h2d_s": min(best["h2d_s"], t2 - t1)}
    del host, views
    return {"bytes": total, **best, "pinned": device == "cuda", "tensors": len(ts)}


class Trainer:
    """A stand-in training step (a chain of matmuls on ``device``), timed."""

    def __init__(self, device: str, dim: int, chain: int) -> None:
        import torch

        g = torch.Generator(device=device).manual_seed(3)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.x = torch.randn(dim, dim, device=device, generator=g, dtype=dtype)
        self.w = torch.randn(dim, dim, device=device, generator=g, dtype=dtype) / dim ** 0.5
        self.device, self.chain = device, chain

    def step(self) -> float:
        t0 = time.perf_counter()
        y = self.x
        for _ in range(self.chain):
            y = y @ self.w
        if self.device == "cuda":  # its own stream, as a step's loss.item() does: not the staging's side streams
            import torch

            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0


def _wait(response: Any) -> None:
    """Wait for what ``dcp.async_save`` returned (a future, or an
    ``AsyncSaveResponse``)."""
    getattr(response, "upload_completion", response).result()


def _planners(kind: str) -> dict:
    """``{"save": kwargs, "load": kwargs}`` of ``dcp.save`` / ``dcp.load``:
    fp_dcp's planners for a kind named ``*_planners``, DCP's defaults else."""
    if not kind.endswith("_planners"):
        return {"save": {}, "load": {}}
    from fp_dcp import FastPersistLoadPlanner, FastPersistSavePlanner

    return {"save": {"planner": FastPersistSavePlanner()}, "load": {"planner": FastPersistLoadPlanner()}}


def _load_checked(sd: Any, path: Path, reader_kind: str, device: str, drop: bool, options: Any = None) -> dict:
    """dcp.load of the checkpoint at ``path`` into zeros like ``sd``, timed
    and compared with ``sd``; ``options``: the fp_dcp reader's."""
    import torch.distributed.checkpoint as dcp

    target = zeros_like(sd)
    cold = _drop_caches() if drop else False
    if reader_kind.startswith("fp_dcp"):
        from fp_dcp import FastPersistReader

        reader = FastPersistReader(path, options=options) if options is not None else FastPersistReader(path)
    else:
        reader = dcp.FileSystemReader(path)
    sync(device)
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=reader, **_planners(reader_kind)["load"])
    sync(device)
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"seconds": seconds, "cold": cold}
    if hasattr(reader, "close"):
        out["direct_bytes"] = reader.last_stats.get("direct_bytes", 0)  # read straight into the tensors
        reader.close()
    bad = mismatches(sd, target)
    return {**out, "bit_exact": not bad, "mismatches": bad}


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def save_and_load(sd: Any, work: Path, device: str, drop: bool, kinds: tuple = ("fp_dcp", "stock")) -> dict:
    """dcp.save then dcp.load through fp_dcp (``fp_dcp_planners``: with its
    planners too) and through the stock FileSystemWriter / FileSystemReader."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    out = {}
    for kind in kinds:
        path = work / kind
        try:
            writer = FastPersistWriter(path) if kind.startswith("fp_dcp") else dcp.FileSystemWriter(path)
            sync(device)
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer, **_planners(kind)["save"])
            out[f"{kind}_save_s"] = time.perf_counter() - t0
            if hasattr(writer, "close"):
                writer.close()
            load = _load_checked(sd, path, kind, device, drop)
            out[f"{kind}_load_s"] = load.pop("seconds")
            out[f"{kind}_load"] = load
        finally:
            shutil.rmtree(path, ignore_errors=True)
    return out


def _flat(sd: Any, prefix: str = "") -> dict:
    """A nested state dict as ``{"a.b.0": leaf}``."""
    if isinstance(sd, dict):
        items = sd.items()
    elif isinstance(sd, (list, tuple)):
        items = enumerate(sd)
    else:
        return {prefix: sd}
    out: dict = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def peer_save_load(sd: Any, work: Path, device: str, drop: bool) -> dict:
    """Meta's torch_checkpointing where it is installed (carried as a wheel,
    docs/GPU.md): the same state flattened to its keys, saved in the
    configuration the CPU benchmark uses (synchronous, buffered files,
    fsynced in the clock), loaded cold into zeroed tensors and compared bit
    for bit."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as e:
        return {"skipped": f"torch_checkpointing is not installed ({e})"}
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_save_load import _fsync_tree, _tc_key, _tc_manager

    flat = _flat(sd)
    keys = {_tc_key(k): k for k in flat}
    path = work / "torch_checkpointing"
    try:
        m = _tc_manager()
        sync(device)
        t0 = time.perf_counter()
        m.save(str(path), {t: flat[k] for t, k in keys.items()})
        m.close()
        _fsync_tree(path)
        saved = time.perf_counter() - t0
        target = {t: torch.zeros_like(flat[k]) if isinstance(flat[k], torch.Tensor) else None for t, k in keys.items()}
        cold = _drop_caches() if drop else False
        m = _tc_manager()
        sync(device)
        t0 = time.perf_counter()
        loaded = m.load(str(path), into=dict(target)) or {}  # (an object's None: it comes back in the result)
        sync(device)
        seconds = time.perf_counter() - t0
        m.close()
        got = {k: target[t] if target[t] is not None else loaded.get(t) for t, k in keys.items()}
        bad = mismatches(flat, got)
        return {"save_s": saved, "load_s": seconds, "load": {"cold": cold, "bit_exact": not bad, "mismatches": bad}}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def async_saves(sd: Any, work: Path, device: str, trainer: Trainer, saves: int, drop: bool,
                modes: tuple = ("eager", "lazy")) -> dict:
    """Eager and lazy ``dcp.async_save`` through one writer each, ``saves``
    times (the first pays for the host arena): the eager save's blocked
    time; the lazy save's return time, time to ``staging_completion`` and
    the training steps run meanwhile against steps run alone.  A mode named
    ``*_planners`` (``lazy_planners``) saves with fp_dcp's planners."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    out: dict[str, Any] = {}
    for mode in modes:
        rows = []
        lazy = mode.startswith("lazy")
        writer = FastPersistWriter(work / mode, staging="lazy" if lazy else "eager")
        try:
            for i in range(saves):
                path = work / mode / f"{i}"
                alone = [trainer.step() for _ in range(5)]
                sync(device)
                staged_at: list[float] = []
                t0 = time.perf_counter()
                response = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, **_planners(mode)["save"])
                returned = time.perf_counter() - t0
                row = {"returned_s": returned}
                if lazy:
                    staging = response.staging_completion
                    staging.add_done_callback(lambda _f: staged_at.append(time.perf_counter()))
                    beside = []
                    while not staging.done():
                        beside.append(trainer.step())
                    staging.result()
                    row.update(staged_s=(staged_at[0] if staged_at else time.perf_counter()) - t0,
                               steps_beside=len(beside), step_alone_s=sorted(alone)[len(alone) // 2],
                               step_beside_s=(sum(beside) / len(beside)) if beside else None)
                _wait(response)
                row["saved_s"] = time.perf_counter() - t0
                rows.append(row)
                if i == saves - 1:
                    reader = "fp_dcp_planners" if mode.endswith("_planners") else "fp_dcp"
                    out[f"{mode}_load"] = _load_checked(sd, path, reader, device, drop)
                shutil.rmtree(path, ignore_errors=True)
        finally:
            writer.close()
            shutil.rmtree(work / mode, ignore_errors=True)
        out[mode] = rows
    return out


def disk_pass(work: Path, nbytes_: int) -> dict:
    """The disk alone: fp_dcp's engine into one huge-page buffer (and fio
    when installed), a write then a cold read of ``nbytes_``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _common as C

    out = {}
    methods = ["hugebuf"] + (["fio"] if C.fio_path() else [])
    for method in methods:
        f = work / f"raw-{method}.bin"
        w = C.raw_device_io("write", f, nbytes_, method=method, block_size=4 * MiB, iodepth=8)
        _drop_caches()
        r = C.raw_device_io("read", f, nbytes_, method=method, block_size=4 * MiB, iodepth=8)
        out[method] = {"bytes": w["bytes"], "write_s": w["seconds"], "read_s": r["seconds"], "note": r["note"]}
        f.unlink()
    return out


def cpu_tensor_in_place(work: Path, nbytes_: int) -> dict:
    """What the disk's file system asks of O_DIRECT memory (statx) and
    whether a large CPU tensor where torch put it (64 bytes past a page) is
    saved straight from its memory and loaded straight into it: in place
    where the memory alignment is at most 64 (NVMe: 4), through the bounce
    buffers otherwise.  Timed both ways where it goes in place: the default,
    and with the memory held to the offsets' alignment (``alignment_bytes``),
    which sends it through the bounce buffers; loads cold."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistOptions, FastPersistWriter, _native

    mem, off = _native.probe_alignment(str(work))
    # 64 bytes past a page, where torch puts a large tensor (an allocation can
    # start on a page: then the "bounced" way would go in place too)
    buf = torch.randint(-(1 << 31), 1 << 31, ((nbytes_ + 4096) // 4,), dtype=torch.int32)
    skip = (64 - buf.data_ptr()) % 4096 // 4
    sd = {"t": buf[skip:skip + nbytes_ // 4]}
    out: dict[str, Any] = {"memory_alignment": mem, "offset_alignment": off, "bytes": nbytes_,
                           "source_past_page": sd["t"].data_ptr() % 4096}
    bounced = FastPersistOptions(alignment_bytes=max(mem, off, os.statvfs(work).f_bsize))
    for mode, options in (("default", FastPersistOptions()), ("bounced", bounced)):
        path = work / f"cpu_tensor_{mode}"
        with FastPersistWriter(path, options=options) as w:
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=w)
            save_s = time.perf_counter() - t0
            zc = w.last_stats["zero_copy_bytes"]
        load = _load_checked(sd, path, "fp_dcp", "cpu", True, options)
        shutil.rmtree(path, ignore_errors=True)
        out[mode] = {"save_s": save_s, "load_s": load.pop("seconds"), "zero_copy_bytes": zc, **load}
        if zc == 0 and load["direct_bytes"] == 0:
            break  # nothing went in place: the second way is the same
    return out


# ------------------------------------------------------------- the report


class Report:
    """Steps run under a time budget, each guarded; the JSON rewritten after
    each one."""

    def __init__(self, out: Path, budget_s: float, meta: dict) -> None:
        self.path = out / "gpu_check.json"
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {**meta, "steps": {}, "failed": [], "skipped": []}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def step(self, name: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        if self.left() < need_s:
            self.data["skipped"].append({"step": name, "why": f"{self.left():.0f} s of the budget left"})
            self.save()
            return None
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - recorded; the other steps go on
            if isinstance(e, KeyboardInterrupt):
                raise
            detail = getattr(e, "detail", {})
            self.data["failed"].append({"step": name, "error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()[-4000:], **detail})
            print(f"gpu_check: {name} FAILED: {type(e).__name__}: {e}", flush=True)
            result = None
        else:
            self.data["steps"][name] = result
        self.data.setdefault("step_seconds", {})[name] = time.perf_counter() - t0
        self.save()
        return result

    def save(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.start
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _gbps(nbytes_: int, seconds: float | None) -> str:
    return f"{nbytes_ / seconds / 1e9:.2f}" if seconds else "-"


def table(data: dict) -> str:
    """One row per figure: bytes, seconds, GB/s, and the reference of the same run."""
    rows = [("state dict", "step", "seconds", "GB/s", "reference", "ref GB/s", "ratio", "bit-exact")]
    disk = data["steps"].get("disk") or {}
    raw = disk.get("hugebuf") or {}
    for name in ("big", "small"):
        s = data["steps"]
        n = (s.get(f"{name}.make") or {}).get("bytes")
        if not n:
            continue
        ref = s.get(f"{name}.copy_ceiling") or {}

        def row(step, sec, ref_name, ref_s, exact="", nb=n):
            ratio = f"{ref_s / sec:.2f}" if sec and ref_s else "-"
            rows.append((name, step, f"{sec:.3f}" if sec else "-", _gbps(nb, sec), ref_name, _gbps(nb, ref_s),
                         ratio, exact))

        sl = s.get(f"{name}.save_load") or {}
        d2h, h2d = ref.get("d2h_s"), ref.get("h2d_s")
        disk_w = raw.get("write_s") * n / raw["bytes"] if raw.get("bytes") else None
        disk_r = raw.get("read_s") * n / raw["bytes"] if raw.get("bytes") else None
        row("copy_ D2H (pinned)", d2h, "", None)
        row("copy_ H2D (pinned)", h2d, "", None)
        slower_w = max(x for x in (d2h, disk_w) if x) if (d2h or disk_w) else None
        slower_r = max(x for x in (h2d, disk_r) if x) if (h2d or disk_r) else None
        for kind in ("fp_dcp", "fp_dcp_planners", "stock"):
            if f"{kind}_save_s" not in sl:
                continue
            row(f"{kind} save", sl.get(f"{kind}_save_s"), "max(D2H, disk)", slower_w)
            load = sl.get(f"{kind}_load") or {}
            row(f"{kind} load", sl.get(f"{kind}_load_s"), "max(H2D, disk)", slower_r, str(load.get("bit_exact", "")))
        peer = s.get(f"{name}.peer") or {}
        if peer.get("save_s"):
            row("torch_checkpointing save", peer["save_s"], "max(D2H, disk)", slower_w)
            row("torch_checkpointing load", peer["load_s"], "max(H2D, disk)", slower_r,
                str(peer["load"].get("bit_exact", "")))
        a = s.get(f"{name}.async") or {}
        for mode in ("eager", "lazy", "lazy_planners"):
            for i, r in enumerate(a.get(mode) or []):
                exact = str((a.get(f"{mode}_load") or {}).get("bit_exact", "")) if i == len(a[mode]) - 1 else ""
                row(f"{mode} async #{i + 1} blocked", r["returned_s"], "copy_ D2H", d2h if mode == "eager" else None)
                if mode.startswith("lazy"):
                    row(f"{mode} async #{i + 1} staged", r.get("staged_s"), "copy_ D2H", d2h)
                    if r.get("step_beside_s"):
                        rows.append((name, f"{mode} #{i + 1} step slowdown", "", "", f"{r['steps_beside']} steps",
                                     "", f"{r['step_beside_s'] / r['step_alone_s']:.3f}", ""))
                row(f"{mode} async #{i + 1} saved", r["saved_s"], "", None, exact)
    for method, r in disk.items():
        rows.append(("disk", f"{method} write", f"{r['write_s']:.3f}", _gbps(r["bytes"], r["write_s"]), "", "", "", ""))
        rows.append(("disk", f"{method} read", f"{r['read_s']:.3f}", _gbps(r["bytes"], r["read_s"]), "", "", "", ""))
    cpu = data["steps"].get("cpu_tensor_in_place") or {}
    for mode in ("default", "bounced"):
        m = cpu.get(mode)
        if m is None:
            continue
        what = (f"CPU tensor {cpu['source_past_page']} B past a page, {mode} (O_DIRECT memory alignment "
                f"{cpu['memory_alignment']}; in place {m['zero_copy_bytes'] >> 20} / {m['direct_bytes'] >> 20} MiB)")
        rows.append(("disk", f"{what} save", f"{m['save_s']:.3f}", _gbps(cpu["bytes"], m["save_s"]), "", "", "", ""))
        rows.append(("disk", f"{what} load", f"{m['load_s']:.3f}", _gbps(cpu["bytes"], m["load_s"]), "", "", "",
                     str(m["bit_exact"])))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


# ------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "gpu_check_out"), help="directory for gpu_check.json")
    p.add_argument("--work", default=None, help="directory under which the checkpoints go (default: gpu_check_work in "
                   "the checkout, on its disk); each step removes its own, the run its own sub-directory")
    p.add_argument("--dry-run", action="store_true", help="CPU tensors standing in, small sizes, tests collected only")
    p.add_argument("--big-gib", type=float, default=None, help="model+optimizer state (default 8.25; dry run 1/32)")
    p.add_argument("--tensor-mib", type=float, default=None, help="size of each big tensor (default 64; dry run 2)")
    p.add_argument("--small-count", type=int, default=None, help="small tensors (default 9000; dry run 200)")
    p.add_argument("--async-saves", type=int, default=None, help="async saves per mode (default 2; dry run 1)")
    p.add_argument("--disk-gib", type=float, default=None, help="bytes of the raw disk pass (default 4; dry run 0.03)")
    p.add_argument("--tests", choices=["run", "collect", "none"], default=None,
                   help="the CUDA tests: run (default), collect (dry run default) or none")
    p.add_argument("--step-matmuls", type=int, default=None,
                   help="the training step beside a lazy save: this many 4096x4096 bf16 matmuls (default 8; dry run 2)")
    p.add_argument("--budget-s", type=float, default=450, help="skip steps that would start after this (default 450)")
    p.add_argument("--no-build", action="store_true", help="use the extension as built")
    args = p.parse_args(argv)
    dry = args.dry_run
    for name, real, small in (("big_gib", 8.25, 1 / 32), ("tensor_mib", 64, 2), ("small_count", 9000, 200),
                              ("async_saves", 2, 1), ("disk_gib", 4, 0.03), ("tests", "run", "collect"),
                              ("step_matmuls", 8, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if dry else real)
    return args


def _meta(args: argparse.Namespace, device: str) -> dict:
    import torch

    meta = {"dry_run": args.dry_run, "device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count(),
            "argv": sys.argv, "args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = {"name": props.name, "memory_bytes": props.total_memory,
                       "multiprocessors": props.multi_processor_count}
    return meta


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--build-only"]:
        print(json.dumps(build_extension()))
        return 0
    args = parse(argv)
    out = Path(args.out).resolve()
    base = Path(args.work or ROOT / "gpu_check_work").resolve()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=base))  # only this is removed at the end
    build = None if args.no_build else _guarded_build()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("gpu_check: no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    report = Report(out, args.budget_s, _meta(args, device))
    if build is not None:
        report.data["steps" if "error" not in build else "failed"] = (
            {**report.data["steps"], "build": build} if "error" not in build else [{"step": "build", **build}])
    drop = device == "cuda"
    try:
        report.step("tests", lambda: run_tests(args.tests, max(60.0, report.left() - 240)), need_s=60)
        trainer = Trainer(device, 4096 if device == "cuda" else 256, args.step_matmuls)
        sizes = {"big": lambda: big_state_dict(int(args.big_gib * GiB), int(args.tensor_mib * MiB), device),
                 "small": lambda: small_state_dict(args.small_count, device)}
        for name, make in sizes.items():
            holder: dict[str, Any] = {}

            def made(make=make, holder=holder):
                holder["sd"] = make()
                sync(device)
                return {"bytes": nbytes(holder["sd"]), "tensors": sum(1 for _ in tensors(holder["sd"]))}

            if report.step(f"{name}.make", made, need_s=30) is None:
                continue
            sd = holder["sd"]
            report.step(f"{name}.copy_ceiling", lambda: copy_ceiling(sd, device), need_s=10)
            # fp_dcp's planners matter where DCP's per-item Python does: many small tensors
            kinds = ("fp_dcp", "fp_dcp_planners", "stock") if name == "small" else ("fp_dcp", "stock")
            modes = ("eager", "lazy", "lazy_planners") if name == "small" else ("eager", "lazy")
            report.step(f"{name}.save_load", lambda: save_and_load(sd, work / name, device, drop, kinds), need_s=40)
            report.step(f"{name}.peer", lambda: peer_save_load(sd, work / name, device, drop), need_s=40)
            report.step(f"{name}.async", lambda: async_saves(sd, work / name, device, trainer, args.async_saves, drop,
                                                             modes), need_s=40)
            del sd, holder
            if device == "cuda":
                torch.cuda.empty_cache()
        report.step("disk", lambda: disk_pass(work, int(args.disk_gib * GiB)), need_s=20)
        cpu_bytes = max(64 * MiB, int(args.disk_gib * GiB) // 4)
        report.step("cpu_tensor_in_place", lambda: cpu_tensor_in_place(work, cpu_bytes), need_s=20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        report.save()
    print(table(report.data))
    for f in report.data["failed"]:
        print(f"FAILED {f['step']}: {f['error']}")
    for s in report.data["skipped"]:
        print(f"SKIPPED {s['step']}: {s['why']}")
    print(f"gpu_check: {report.path} ({report.data['elapsed_s']:.0f} s)")
    exact = [v for k, v in _walk_bit_exact(report.data["steps"])]
    return 1 if report.data["failed"] or not all(exact) else 0


def _walk_bit_exact(d: Any, path: str = "") -> Iterator[tuple[str, bool]]:
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "bit_exact":
                yield path, bool(v)
            else:
                yield from _walk_bit_exact(v, f"{path}.{k}")


def _guarded_build() -> dict:
    """build_extension in a child (the compiler's output kept, not printed)."""
    print("gpu_check: build ...", flush=True)
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-only"], cwd=ROOT, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=900)
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"error": f"the build exited {p.returncode}", "output_tail": (p.stdout + p.stderr)[-6000:]}


if __name__ == "__main__":
    sys.exit(main())
