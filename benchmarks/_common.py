"""Shared helpers for the fp_dcp benchmarks.

Everything a benchmark needs besides the thing it measures:

- sizes: ``fmt_size``; sizes are read with the library's
  ``fp_dcp.options.parse_size`` (every unit binary: ``1MB`` = ``1MiB``, as in
  ``FP_DCP_*_BYTES``), which importing this module makes importable (the
  installed package, else this checkout);
- state dicts: a seeded *spec* (``make_spec``) that any process can turn into
  the same state dict (``build_state_dict``) or a zeroed copy to load into
  (``build_state_dict(..., zero=True)``), and ``verify_state_dict`` that checks
  a loaded dict bit for bit against the spec without a second copy in memory;
- memory: ``rss_bytes``, ``peak_rss_bytes``, ``reset_peak_rss`` (VmRSS / VmHWM
  of the calling process; the reset writes 5 to /proc/self/clear_refs);
- caches: ``drop_caches`` (sync + drop_caches when root);
- children: ``run_child`` starts ``python <script> --child <json>`` and reads
  the one result line the child prints with ``emit_result``;
- raw device: ``raw_device_io`` (fio O_DIRECT libaio if on PATH, or
  ``method="hugebuf"``: fp_dcp's engine into one huge-page buffer, else a
  single-request O_DIRECT loop in Python);
- machine: ``hardware_info(dir)``, ``check_free_space``;
- device profiles: ``DeviceProfile("bare" | "throttled" | "ram", dir, iops,
  fs_bytes)``, a context manager: ``throttled`` puts this process (and so its
  children) into a cgroup v1 blkio group limiting the disk under ``dir`` to
  ``iops`` operations per second; ``ram`` makes a file system of ``fs_bytes``
  on a loop device over RAM for the run to work in (``directory``); each is
  torn down on exit;
- the parent side every benchmark shares: ``parser`` (the common flags),
  ``main`` (``--child`` or the parent), ``Bench`` (target and work
  directories, hardware, the JSON report, clean-up), ``entered`` (each device
  profile in turn); ``import_fp_dcp`` (installed package, else this
  checkout), ``timestamp``;
- output: ``summarize``, ``format_table``, ``write_json``.

Only the standard library is imported at module level; torch is imported by the
functions that need it, so a parent process that only orchestrates stays small.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO.parent / "bench_tmp"  # beside the checkout: never inside the repository


def import_fp_dcp():
    """The fp_dcp module: the installed package, else this checkout's."""
    try:
        import fp_dcp  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fp_dcp":
            raise
        sys.path.insert(1, str(REPO))
    import fp_dcp

    return fp_dcp


import_fp_dcp()  # the benchmarks import fp_dcp.options.parse_size (no torch) at their top


def timestamp() -> str:
    import datetime

    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


RESULT_MARKER = "@@BENCH_RESULT "

# --------------------------------------------------------------------------
# the parent side every benchmark shares


def parser(description: str, name: str, *, size: str, size_help: str, quick: str | None = None,
           seed: str | None = None, child_timeout: float | None = None, keep: str | None = None,
           profiles: str | None = None, throttle_iops: int = 1000, dir_help: str | None = None,
           json_help: str | None = None, child: bool = True, **kwargs: Any) -> argparse.ArgumentParser:
    """The argument parser of benchmark ``name`` with the flags they share,
    each with the same name, type and meaning everywhere: ``--size`` (read by
    ``fp_dcp.options.parse_size``), ``--dir``, ``--json`` and the hidden
    ``--child``; and, where the benchmark has them (the keyword is their
    help or default), ``--quick``, ``--seed``, ``--child-timeout``,
    ``--keep`` and ``--profiles`` / ``--throttle-iops`` (device profiles,
    see ``DeviceProfile``).  The benchmark adds its own flags to it."""
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    p = argparse.ArgumentParser(description=description, **kwargs)
    p.add_argument("--size", default=size, help=size_help)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--dir", type=Path, default=None,
                   help=dir_help or f"target directory (default {DEFAULT_DIR})")
    p.add_argument("--json", type=Path, default=None,
                   help=json_help or f"JSON output (default bench_out/{name}-<timestamp>.json in the repo)")
    if seed is not None:
        p.add_argument("--seed", type=int, default=0, help=seed)
    if child_timeout is not None:
        p.add_argument("--child-timeout", type=float, default=child_timeout, help="seconds per subprocess")
    if keep is not None:
        p.add_argument("--keep", action="store_true", help=keep)
    if profiles is not None:
        p.add_argument("--profiles", default=profiles, help=PROFILES_HELP)
        p.add_argument("--throttle-iops", type=int, default=throttle_iops,
                       help="read and write IOPS limit of the throttled profile")
    if child:
        p.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    return p


PROFILES_HELP = ("device profiles, each a full run: bare (the disk as it is), throttled (the same disk limited "
                 "per operation by a cgroup v1 blkio group), ram (an ext4 file system on a loop device over RAM: "
                 "a fast device; its speed is the CPU's); throttled and ram need root and are skipped with a "
                 "message otherwise")


def check_profiles(p: argparse.ArgumentParser, names: str) -> list[str]:
    """The comma list of ``--profiles``, or a usage error naming the unknown ones."""
    got = [n for n in names.split(",") if n]
    bad = set(got) - set(PROFILES)
    if bad:
        p.error(f"unknown profiles {sorted(bad)}: choose from {', '.join(PROFILES)}")
    return got


def main(child_main: Callable[[str], Any], parent_main: Callable[[Any], int], argv: list[str] | None = None) -> int:
    """A benchmark script's entry point: ``script --child <json>`` (a
    subprocess started by ``run_child``) runs ``child_main(json)``, anything
    else ``parent_main(argv)``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "--child":
        child_main(args[1])
        return 0
    return parent_main(argv)


class Bench:
    """One benchmark run's parent side, as a context manager::

        with C.Bench("save_load", args) as bench:   # args.dir, args.json, args.keep
            ... write under bench.workdir ...
            bench.write(report)

    On creation: SIGTERM unwinds like Ctrl-C (children are killed and work
    directories removed in ``finally``), the target directory (``--dir``,
    else ``DEFAULT_DIR``) exists, ``ts`` is the run's timestamp and
    ``workdir`` (``<target>/<name>-<ts>-<pid>``, or the target itself when
    the benchmark names one: all of it is the run's) is created when the
    benchmark asks (``need_bytes``: it first checks that much is free).  On
    exit, unless ``--keep``: the work directory is removed, and the target
    too when this run created it.  ``hardware()`` measures and prints the
    machine; ``report(**fields)`` starts the JSON report with the fields
    every benchmark writes; ``write(report)`` writes it to ``--json`` (else
    ``bench_out/<name>-<ts>.json``) and prints where.
    """

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path | None = None) -> None:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        self.name, self.args = name, args
        self.ts = timestamp()
        self.target = Path(workdir or args.dir or DEFAULT_DIR)
        self._created_target = not self.target.exists()
        self.target.mkdir(parents=True, exist_ok=True)
        self.workdir = self.target if workdir else self.target / f"{name}-{self.ts}-{os.getpid()}"

    def make_workdir(self, need_bytes: int | None = None) -> Path:
        if need_bytes is not None:
            check_free_space(self.target, need_bytes)
        self.workdir.mkdir(exist_ok=True)
        return self.workdir

    def hardware(self) -> dict:
        hw = hardware_info(self.target)
        for line in hardware_lines(hw):
            print(line)
        return hw

    def report(self, **fields: Any) -> dict:
        return {"benchmark": self.name, "timestamp": self.ts, "argv": sys.argv[1:], **fields}

    def json_path(self) -> Path:
        return Path(self.args.json) if self.args.json else REPO / "bench_out" / f"{self.name}-{self.ts}.json"

    def write(self, report: dict) -> Path:
        out = write_json(self.json_path(), report)
        print(f"\nJSON: {out}")
        return out

    def __enter__(self) -> "Bench":
        return self

    def __exit__(self, *exc: Any) -> None:
        if getattr(self.args, "keep", False):
            return
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._created_target:
            try:
                self.target.rmdir()
            except OSError:
                pass


def entered(profiles: Sequence["DeviceProfile"], skipped: list[str] | None = None):
    """Each device profile in turn, entered (this process and its children
    inside its cgroup while the caller's loop body runs).  One that cannot be
    set up is announced as SKIPPING and, with ``skipped``, its line is
    appended there."""
    for prof in profiles:
        if prof.available:
            with prof:
                if prof.available:  # entering can fail too
                    yield prof
                    continue
        print(f"\nSKIPPING device profile {prof.name}: {prof.why}")
        if skipped is not None:
            skipped.append(f"device profile {prof.name}: SKIPPED ({prof.why})")


# --------------------------------------------------------------------------
# sizes


def fmt_size(n: float, trim: bool = False) -> str:
    """``n`` bytes in binary units with two decimals (``trim``: "4 GiB", not "4.00 GiB")."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            text = f"{n / scale:.2f} {unit}"
            return text.replace(".00 ", " ") if trim else text
    return f"{int(n)} B"


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def proc_io(pid: int, counter: str) -> int | None:
    """A counter of ``/proc/<pid>/io`` (``read_bytes``, ``write_bytes``, ...);
    None where the file cannot be read or has no such counter."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith(counter + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------
# state-dict generation

# One pool of random values per dtype; a tensor is filled from slices of its
# dtype's pool at offsets derived from (seed, tensor index, chunk index), so
# any process regenerates or verifies any tensor without storing a copy and
# generation runs at memcpy speed instead of RNG speed.
POOL_ELEMS = 4 * MiB
CHUNK_ELEMS = POOL_ELEMS // 2

DTYPES = ("float32", "bfloat16", "float16", "int64", "bool")


@dataclass
class TensorSpec:
    key: str
    dtype: str
    shape: tuple[int, ...]
    index: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class StateDictSpec:
    """A deterministic description of a state dict (JSON-able)."""

    mix: str
    seed: int
    tensors: list[TensorSpec]
    objects: dict[str, Any] = field(default_factory=dict)  # non-tensor items

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel * _ELEM_SIZE[t.dtype] for t in self.tensors)

    def to_json(self) -> dict:
        return {"mix": self.mix, "seed": self.seed, "objects": self.objects,
                "tensors": [[t.key, t.dtype, list(t.shape), t.index] for t in self.tensors]}

    @classmethod
    def from_json(cls, d: dict) -> "StateDictSpec":
        return cls(d["mix"], d["seed"],
                   [TensorSpec(k, dt, tuple(s), i) for k, dt, s, i in d["tensors"]],
                   d["objects"])


_ELEM_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "bool": 1}


def make_spec(mix: str, size_bytes: int, seed: int = 0) -> StateDictSpec:
    """Describe a state dict of about ``size_bytes`` of tensor payload.

    ``large``: 32–64 2-d tensors of float32/bfloat16 of 0.75x–1.25x the mean
    size, plus a ``step`` int.
    ``small``: thousands of tensors of 1 KiB – 4 MiB (log-uniform), dtypes
    float32 / bfloat16 / float16 / int64 / bool, 0-d to 3-d, plus non-tensor
    items (ints, floats, strings, small dicts) that DCP stores as bytes.
    """
    rng = random.Random(seed)
    tensors: list[TensorSpec] = []
    objects: dict[str, Any] = {"step": 1000 + seed}
    if mix == "large":
        n = max(32, min(64, round(size_bytes / (64 * MiB))))
        weights = [rng.uniform(0.75, 1.25) for _ in range(n)]
        total_w = sum(weights)
        cols = 4096
        for i, w in enumerate(weights):
            dtype = "float32" if i % 2 == 0 else "bfloat16"
            nbytes = size_bytes * w / total_w
            rows = max(1, int(nbytes // (cols * _ELEM_SIZE[dtype])))
            tensors.append(TensorSpec(f"model.layers.{i}.weight", dtype, (rows, cols), i))
    elif mix == "small":
        dtypes, dweights = zip(*[("float32", 40), ("bfloat16", 25), ("float16", 10),
                                 ("int64", 15), ("bool", 10)])
        total = 0
        i = 0
        lo, hi = math.log(KiB), math.log(4 * MiB)
        while total < size_bytes:
            dtype = rng.choices(dtypes, dweights)[0]
            es = _ELEM_SIZE[dtype]
            r = rng.random()
            if r < 0.05:
                shape: tuple[int, ...] = ()
            else:
                numel = max(1, int(math.exp(rng.uniform(lo, hi))) // es)
                numel = min(numel, (size_bytes - total) // es + 1)
                ndim = rng.choice((1, 2, 2, 3))
                if ndim == 1:
                    shape = (numel,)
                else:
                    c = rng.choice((1, 3, 17, 64, 128, 257, 1024))
                    rows = max(1, numel // c)
                    if ndim == 3 and rows >= 8:
                        a = rng.choice((2, 4, 8))
                        shape = (a, rows // a, c)
                    else:
                        shape = (rows, c)
            kind = rng.choice(("weight", "bias", "exp_avg", "exp_avg_sq", "mask", "idx"))
            t = TensorSpec(f"model.block{i // 8}.t{i % 8}.{kind}", dtype, shape, i)
            tensors.append(t)
            total += t.numel * es
            i += 1
        for j in range(24):
            if j % 3 == 0:
                objects[f"meta.count{j}"] = rng.randrange(1 << 40)
            elif j % 3 == 1:
                objects[f"meta.name{j}"] = "run-" + "".join(rng.choices("abcdefgh", k=12))
            else:
                objects[f"meta.cfg{j}"] = {"lr": round(rng.uniform(1e-5, 1e-3), 8),
                                           "schedule": rng.choice(("cosine", "linear")),
                                           "warmup": rng.randrange(1000)}
    else:
        raise ValueError(f"unknown mix {mix!r}: choose large or small")
    return StateDictSpec(mix, seed, tensors, objects)


class _Pools:
    def __init__(self, seed: int):
        self.seed = seed
        self._pools: dict[str, Any] = {}

    def get(self, dtype: str):
        import torch

        p = self._pools.get(dtype)
        if p is None:
            g = torch.Generator().manual_seed(self.seed * 131 + DTYPES.index(dtype))
            if dtype in ("float32", "bfloat16", "float16"):
                p = torch.randn(POOL_ELEMS, generator=g).to(getattr(torch, dtype))
            elif dtype == "int64":
                p = torch.randint(-(1 << 62), 1 << 62, (POOL_ELEMS,), generator=g, dtype=torch.int64)
            else:
                p = torch.randint(0, 2, (POOL_ELEMS,), generator=g, dtype=torch.uint8).bool()
            self._pools[dtype] = p
        return p


def _chunks(seed: int, t: TensorSpec):
    """Yield (start, length, pool_offset) covering the tensor's flat elements."""
    n = t.numel
    j = 0
    for start in range(0, n, CHUNK_ELEMS):
        length = min(CHUNK_ELEMS, n - start)
        off = random.Random((seed << 40) ^ (t.index << 16) ^ j).randrange(POOL_ELEMS - length + 1)
        yield start, length, off
        j += 1


def _placeholder(value: Any) -> Any:
    """A same-typed value that differs from ``value`` (what a load must overwrite)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return -1
    if isinstance(value, float):
        return -1.0
    if isinstance(value, str):
        return ""
    if isinstance(value, dict):
        return {k: _placeholder(v) for k, v in value.items()}
    return None


class StateDictFactory:
    """Builds and verifies the state dict of a spec; keeps the random pools."""

    def __init__(self, spec: StateDictSpec):
        self.spec = spec
        self.pools = _Pools(spec.seed)

    def build(self, zero: bool = False) -> dict:
        """The state dict (flat tensor keys, plus the spec's non-tensor items).

        ``zero=True`` gives the preallocated target of a load: zeroed tensors
        (pages touched) and placeholder non-tensor items.
        """
        import copy

        import torch

        sd: dict[str, Any] = {}
        for t in self.spec.tensors:
            dt = getattr(torch, t.dtype)
            if zero:
                sd[t.key] = torch.zeros(t.shape, dtype=dt)
                continue
            x = torch.empty(t.shape, dtype=dt)
            flat = x.view(-1)
            pool = self.pools.get(t.dtype)
            for start, length, off in _chunks(self.spec.seed, t):
                flat[start:start + length].copy_(pool[off:off + length])
            sd[t.key] = x
        for k, v in self.spec.objects.items():
            sd[k] = _placeholder(v) if zero else copy.deepcopy(v)
        return sd

    def verify(self, sd: dict, originals: dict | None = None, max_errors: int = 5) -> list[str]:
        """Compare ``sd`` with the spec bit for bit; return a list of problems.

        ``originals`` (key -> tensor object before the load) also checks the
        load wrote into the preallocated tensors instead of replacing them.
        """
        import torch

        errors: list[str] = []

        def err(msg: str) -> bool:
            errors.append(msg)
            return len(errors) >= max_errors

        for t in self.spec.tensors:
            x = sd.get(t.key)
            if not isinstance(x, torch.Tensor):
                if err(f"{t.key}: missing or not a tensor ({type(x).__name__})"):
                    break
                continue
            if originals is not None and x is not originals.get(t.key):
                if err(f"{t.key}: replaced by a new tensor, not loaded into the preallocated one"):
                    break
                continue
            if str(x.dtype) != f"torch.{t.dtype}" or tuple(x.shape) != t.shape:
                if err(f"{t.key}: got {x.dtype} {tuple(x.shape)}, want {t.dtype} {t.shape}"):
                    break
                continue
            flat = x.reshape(-1)
            pool = self.pools.get(t.dtype)
            for start, length, off in _chunks(self.spec.seed, t):
                if not torch.equal(flat[start:start + length], pool[off:off + length]):
                    err(f"{t.key}: elements {start}..{start + length} differ")
                    break
            if len(errors) >= max_errors:
                break
        for k, v in self.spec.objects.items():
            if sd.get(k) != v:
                if err(f"{k}: got {sd.get(k)!r}, want {v!r}"):
                    break
        return errors


# --------------------------------------------------------------------------
# memory


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is None:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB
    return kb * KiB


def peak_rss_bytes() -> int:
    """Peak RSS of this process (VmHWM; since the last ``reset_peak_rss``)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB
    return kb * KiB


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# page cache


def drop_caches() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Returns (done, why not)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as e:
        return False, f"cannot drop page cache ({e.strerror}; needs root): loads are WARM"


# --------------------------------------------------------------------------
# child processes


def emit_result(result: dict) -> None:
    """Child side: print the one result line the parent reads."""
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result), flush=True)


def run_child(script: str | Path, spec: dict, timeout_s: float | None = None,
              extra_env: dict | None = None) -> dict:
    """Run ``python script --child <json spec>``; return its result dict.

    The result gets ``rc``, ``wall_s`` and, when the child printed no result
    line, ``ok=False`` with ``error`` holding the tail of its output. Memory is
    measured by the child itself (``rss_bytes`` / ``peak_rss_bytes``), since it
    alone knows when its state dict was ready.
    """
    env = dict(os.environ)
    if extra_env:
        env.update(extra_env)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script), "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, errtxt = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, errtxt = proc.communicate()
        timed_out = True
    except BaseException:  # interrupted: take the child down with us
        proc.kill()
        proc.wait()
        raise
    result: dict | None = None
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
            break
    if result is None:
        tail = (errtxt or out or "").strip().splitlines()[-8:]
        why = f"timed out after {timeout_s}s" if timed_out else f"exit code {proc.returncode}"
        result = {"ok": False, "error": f"child printed no result ({why}): " + " | ".join(tail)}
    result["rc"] = proc.returncode
    result["wall_s"] = time.perf_counter() - t0
    if errtxt and not result.get("ok", False):
        result.setdefault("stderr_tail", errtxt.strip().splitlines()[-8:])
    return result


# --------------------------------------------------------------------------
# raw device


def fio_path() -> str | None:
    return shutil.which("fio")


def raw_device_io(op: str, path: str | Path, nbytes: int, method: str = "auto",
                  block_size: int = 4 * MiB, iodepth: int = 16, numjobs: int = 1, rewrite: bool = False) -> dict:
    """Sequential O_DIRECT ``op`` ("write" or "read") of ``nbytes`` at ``path``.

    ``method``: "fio" (libaio, ``numjobs`` jobs of ``iodepth`` each, every
    job on its own contiguous slice of the file), "python" (one request
    at a time: os.pwritev/os.preadv of a page-aligned buffer), or "auto"
    (fio if on PATH). A write ends with fsync. Returns
    ``{"method", "bytes", "seconds", "note"}``; the read reads the file the
    write left. ``nbytes`` is rounded up to a whole number of blocks.
    ``rewrite`` ("hugebuf" only): the write goes over the blocks of the file
    already at ``path`` (made first, outside the clock, where there is none
    of that size): what a recycled save writes into.
    """
    if method == "auto":
        method = "fio" if fio_path() else "python"
    nbytes = -(-nbytes // (block_size * numjobs)) * block_size * numjobs
    path = str(path)
    if numjobs != 1 and method != "fio":
        raise ValueError(f"numjobs={numjobs} needs method='fio', not {method!r}")
    if method == "fio":
        fio = fio_path()
        if fio is None:
            raise RuntimeError("fio requested but not on PATH")
        cmd = [fio, "--name=raw", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
               f"--size={nbytes // numjobs}", f"--offset_increment={nbytes // numjobs}",
               f"--iodepth={iodepth}", "--ioengine=libaio", "--direct=1",
               f"--numjobs={numjobs}", "--output-format=json", "--group_reporting"]
        if op == "write":
            cmd += ["--end_fsync=1"]
        logs = tempfile.mkdtemp(prefix="fp_dcp_fio_") if numjobs > 1 else None
        if logs is not None:  # every request's completion time and latency, for the span across jobs
            cmd += [f"--write_lat_log={logs}/raw", "--log_unix_epoch=1"]
        try:
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                raise RuntimeError(f"fio failed ({p.returncode}): {p.stderr.strip()[-500:]}")
            span = _fio_span(logs) if logs is not None else None
        finally:
            if logs is not None:
                shutil.rmtree(logs, ignore_errors=True)
        data = json.loads(p.stdout[p.stdout.index("{"):])
        job = data["jobs"][0][op]
        io_bytes = int(job["io_bytes"])
        seconds = io_bytes / float(job["bw_bytes"]) if job["bw_bytes"] else float("inf")
        out = {"method": "fio", "bytes": io_bytes, "seconds": seconds, "wall_s": wall,
               "note": f"fio {op} O_DIRECT libaio bs={fmt_size(block_size)} iodepth={iodepth} numjobs={numjobs}"
                       + (" end_fsync=1" if op == "write" else ""),
               "fio_version": data.get("fio version")}
        if span is not None:
            # fio's group figure divides by the longest job's own runtime, which
            # does not say when each job started (on a loop device over RAM four
            # jobs once reported 6.86 GB/s, 4.2 when run alone); the span from
            # the first request sent to the last completed, across jobs, is the
            # least time they took
            out["fio_group_seconds"], out["span_seconds"] = seconds, span
            out["seconds"] = max(seconds, span)
            out["note"] += ", timed from the first request to the last completion across jobs"
        return out
    if rewrite and method != "hugebuf":
        raise ValueError(f"rewrite needs method='hugebuf', not {method!r}")
    if method == "hugebuf":
        return _raw_hugebuf(op, path, nbytes, block_size, iodepth, rewrite and op == "write")
    if method != "python":
        raise ValueError(f"unknown raw method {method!r}: choose fio, hugebuf, python or auto")
    buf = mmap.mmap(-1, block_size)  # page aligned
    if op == "write":
        buf.write(os.urandom(block_size))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            t0 = time.perf_counter()
            for off in range(0, nbytes, block_size):
                n = os.pwritev(fd, [buf], off)
                if n != block_size:
                    raise OSError(f"short write {n} at {off} in {path}")
            os.fsync(fd)
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    elif op == "read":
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            t0 = time.perf_counter()
            for off in range(0, nbytes, block_size):
                n = os.preadv(fd, [buf], off)
                if n != block_size:
                    raise OSError(f"short read {n} at {off} in {path}")
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    else:
        raise ValueError(f"op must be write or read, not {op!r}")
    buf.close()
    return {"method": "python", "bytes": nbytes, "seconds": seconds,
            "note": f"python O_DIRECT {op}, bs={fmt_size(block_size)}, ONE request at a time "
                    "(single-request baseline, below what the device can do with a queue)"}


def _fio_span(logs: str) -> float | None:
    """Seconds from the first request submitted to the last completed, over
    the latency logs (``--write_lat_log`` with ``--log_unix_epoch``: per
    request its completion time in ms and its latency in ns) of every job
    in ``logs``; None where there are none."""
    first = last = None
    for path in Path(logs).glob("raw_lat.*.log"):
        with open(path) as f:
            for line in f:
                fields = line.split(",")
                if len(fields) < 2:
                    continue
                done_ms, lat_ns = int(fields[0]), int(fields[1])
                sent_ms = done_ms - lat_ns / 1e6
                first = sent_ms if first is None else min(first, sent_ms)
                last = done_ms if last is None else max(last, done_ms)
    if first is None or last is None or last <= first:
        return None
    return (last - first) / 1e3


def _raw_hugebuf(op: str, path: str, nbytes: int, block_size: int, iodepth: int, rewrite: bool = False) -> dict:
    """Sequential O_DIRECT ``op`` of the file through fp_dcp's native engine
    (kernel AIO) into / from one page-locked buffer of 2 MiB transparent huge
    pages: no checkpoint format, no planning, just the device (the
    measurement of ``fp-dcp tune``: fp_dcp.tools.tune.engine_pass).  On a VM
    with virtio-blk it shows what fio's 4 KiB-page buffers hide: every 4 KiB
    page is one more DMA segment, and this disk reads about twice as fast
    into huge pages (fio 1.3-2.0 GB/s in every configuration tried, this
    3.8-3.9 GB/s on the same file, cold)."""
    from fp_dcp.tools.tune import engine_pass

    if rewrite:
        try:
            fresh = os.stat(path).st_size != nbytes
        except FileNotFoundError:
            fresh = True
        if fresh:
            engine_pass("write", str(path), nbytes, block_size, iodepth, kind="aio")
    r = engine_pass(op, str(path), nbytes, block_size, iodepth, kind="aio", rewrite=rewrite)
    return {"method": "hugebuf", "bytes": nbytes, "seconds": r["seconds"],
            "note": f"fp_dcp._aio engine O_DIRECT {op} " + ("over an existing file's blocks from" if rewrite else "into")
                    + f" one huge-page buffer, bs={fmt_size(block_size)} "
                    f"qd={iodepth} (no checkpoint format)" + (" + fsync" if op == "write" else "")}


# --------------------------------------------------------------------------
# machine


def _mount_of(path: str | Path) -> tuple[str, str, str]:
    """(mount point, file system type, source device) of the mount holding path."""
    p = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, src)
    except OSError:
        pass
    return best


def block_device_of(path: str | Path) -> dict:
    """Name (and, where sysfs says, model / rotational / scheduler) of the disk."""
    info: dict[str, Any] = {}
    try:
        st = os.stat(path)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        sysdev = Path(f"/sys/dev/block/{major}:{minor}")
        if sysdev.exists():
            real = sysdev.resolve()
            info["name"] = real.name
            disk = real if (real / "queue").exists() else real.parent
            info["disk"] = disk.name
            for key, rel in (("model", "device/model"), ("rotational", "queue/rotational"),
                             ("scheduler", "queue/scheduler"),
                             ("logical_block_size", "queue/logical_block_size"),
                             ("physical_block_size", "queue/physical_block_size")):
                try:
                    info[key] = (disk / rel).read_text().strip()
                except OSError:
                    pass
    except OSError:
        pass
    if "name" not in info:
        info["name"] = _mount_of(path)[2]
    return info


def disk_dev_of(path: str | Path) -> tuple[str, str] | None:
    """("major:minor", name) of the whole disk holding ``path`` (a partition's
    parent), as cgroup blkio throttling wants it; None where sysfs does not say."""
    try:
        st = os.stat(path)
        sysdev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        disk = sysdev if (sysdev / "queue").exists() else sysdev.parent
        return (disk / "dev").read_text().strip(), disk.name
    except OSError:
        return None


BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
PROFILES = ("bare", "throttled", "ram")
RAM_SHM = Path("/dev/shm")


def _run_tool(*argv: str) -> str:
    """Run a system tool (losetup, mkfs.ext4, mount, umount): its stdout, or
    OSError with its stderr."""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip() or f'exit status {r.returncode}'}")
    return r.stdout.strip()


def meminfo(field: str) -> int | None:
    """A /proc/meminfo figure (``"MemTotal"``, ``"MemAvailable"``) in bytes;
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def ram_paths(pid: int) -> tuple[Path, Path]:
    """(the file in /dev/shm, the mount point) of process ``pid``'s ram profile."""
    return RAM_SHM / f"fp_dcp_bench_{pid}.img", Path(f"/tmp/fp_dcp_bench_ram_{pid}")


def _remove_ram(image: Path, mount: Path | None, tries: int = 1) -> bool:
    """Undo what a ram profile made, whichever of it is there: unmount
    ``mount`` (``tries`` times, 0.1 s apart, while busy), remove the mount
    point, detach every loop device over ``image`` and delete it.  False,
    with nothing detached or deleted, where the file system stays busy;
    OSError where a tool fails or the mount point is not empty (not a mount
    of ours)."""
    for attempt in range(tries):
        if mount is None or not os.path.ismount(mount):
            break
        try:
            _run_tool("umount", str(mount))
        except OSError:
            if attempt + 1 < tries:
                time.sleep(0.1)
    if mount is not None:
        if os.path.ismount(mount):
            return False
        if mount.is_dir():
            mount.rmdir()
    for line in _run_tool("losetup", "-j", str(image)).splitlines():
        _run_tool("losetup", "-d", line.split(":", 1)[0])
    image.unlink(missing_ok=True)
    return True


def reclaim_stale_ram() -> list[str]:
    """Undo the ram profiles of benchmark processes that are gone (killed
    before they could tear theirs down, their file still holding its size in
    RAM): found by their names (:func:`ram_paths`).  What a live process
    holds is left alone.  Returns the files removed."""
    removed = []
    for image in sorted(RAM_SHM.glob("fp_dcp_bench_*.img")):
        m = re.fullmatch(r"fp_dcp_bench_(\d+)\.img", image.name)
        if m is None or _alive(int(m.group(1))):
            continue
        mount = ram_paths(int(m.group(1)))[1]
        if not _remove_ram(image, mount):
            raise OSError(f"{mount} is busy")
        removed.append(str(image))
    return removed


class DeviceProfile:
    """A device profile the benchmark runs inside, as a context manager.

    ``bare``: the disk as it is.  ``throttled``: the same disk limited to
    ``iops`` read and ``iops`` write operations per second, the way a cloud
    volume that charges per operation is: a cgroup v1 blkio group
    (``blkio.throttle.read_iops_device`` / ``write_iops_device`` for the disk
    under ``target``), which the calling process joins, so every child it
    starts (fp_dcp, the stock writer, fio, ...) runs inside it; on exit the
    process goes back to the root group and the group is removed.

    ``ram``: a fast device, where the CPU and Python costs of a save or load
    show that a slower disk hides: an ext4 file system of ``fs_bytes`` on a
    loop device over a file in ``/dev/shm`` (RAM), every page of the file
    written before the run (pages the loop device writes for the first time,
    absent or only fallocated, went at a fraction of its speed) and never
    given back by discards while it runs; the run works in
    :attr:`directory` instead of ``target``.  ``run_bytes``: the memory the
    run needs besides (its state dicts), checked with the file system's.  On
    exit it is unmounted, detached and deleted; the set-up first removes those
    of benchmark processes that were killed (:func:`reclaim_stale_ram`).  Its
    speed is the CPU's: the loop device copies every byte on this machine's
    cores, beside the contender's own work.

    Where a profile cannot be set up (not root, no cgroup v1 blkio, no disk
    found, no loop devices or not enough free memory) ``available`` is False
    and ``why`` says why; nothing was changed.
    """

    def __init__(self, name: str, target: str | Path, iops: int = 2000, fs_bytes: int = 0,
                 run_bytes: int = 0) -> None:
        if name not in PROFILES:
            raise ValueError(f"unknown device profile {name!r}: choose from {', '.join(PROFILES)}")
        self.name, self.target, self.iops = name, Path(target), iops
        self.group: Path | None = None
        self.available, self.why = True, ""
        self.fs_bytes, self.run_bytes = fs_bytes, run_bytes
        self.directory: Path | None = None  # where a ram profile's run works, while entered
        self._image: Path | None = None
        self._mount: Path | None = None
        dev = disk_dev_of(target) if name != "ram" else None
        self.dev, self.disk = dev if dev else (None, None)
        self.max_sectors_kb = self._max_sectors_kb()
        if name == "throttled":
            if self.dev is None:
                self.available, self.why = False, f"no block device found under {target}"
            elif not (BLKIO_ROOT / "blkio.throttle.read_iops_device").exists():
                self.available, self.why = False, f"no cgroup v1 blkio throttling at {BLKIO_ROOT}"
            elif os.geteuid() != 0:
                self.available, self.why = False, "cgroup blkio throttling needs root"
        elif name == "ram":
            self.why = self._ram_unavailable()
            self.available = not self.why

    def _max_sectors_kb(self) -> int | None:
        if not self.disk:
            return None
        try:
            return int(Path(f"/sys/block/{self.disk}/queue/max_sectors_kb").read_text())
        except (OSError, ValueError):
            return None

    def _ram_unavailable(self) -> str:
        if os.geteuid() != 0:
            return "a loop device and a mount need root"
        if not Path("/dev/loop-control").exists():
            return "no loop devices (/dev/loop-control is missing)"
        missing = [t for t in ("losetup", "mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
        if missing:
            return f"{', '.join(missing)} not on PATH"
        if not RAM_SHM.is_dir():
            return f"no {RAM_SHM}"
        if self.fs_bytes <= 0:
            return "no file system size given (fs_bytes)"
        avail = meminfo("MemAvailable")
        # the file system's pages, the run's own memory (its state dicts) and
        # 2 GiB for the page cache of the buffered contenders and the rest
        need = self.fs_bytes + self.run_bytes + 2 * GiB
        if avail is None or avail < need:
            have = "unknown" if avail is None else fmt_size(avail)
            return (f"needs {fmt_size(need)} of free memory (a {fmt_size(self.fs_bytes)} file system in RAM, "
                    f"{fmt_size(self.run_bytes)} for the run, 2 GiB more); MemAvailable is {have}: "
                    f"use a smaller --size")
        if shutil.disk_usage(RAM_SHM).free < self.fs_bytes:
            return f"{RAM_SHM} has less than {fmt_size(self.fs_bytes)} free"
        return ""

    def describe(self) -> dict:
        return {"profile": self.name, "available": self.available, "why": self.why or None,
                "disk": self.disk, "dev": self.dev, "max_sectors_kb": self.max_sectors_kb,
                "read_iops": self.iops if self.name == "throttled" else None,
                "write_iops": self.iops if self.name == "throttled" else None,
                "fs_bytes": self.fs_bytes if self.name == "ram" else None}

    def label(self) -> str:
        if self.name == "bare":
            return f"bare ({self.disk or '?'})"
        if self.name == "ram":
            return (f"ram ({self.disk or 'a loop device'}: ext4 of {fmt_size(self.fs_bytes, trim=True)} over "
                    f"a file in {RAM_SHM}, written in full first)")
        return f"throttled ({self.disk or '?'} {self.dev}: {self.iops} read / {self.iops} write IOPS, cgroup v1 blkio)"

    def __enter__(self) -> "DeviceProfile":
        if not self.available:
            return self
        if self.name == "ram":
            try:
                self._set_up_ram()
            except (OSError, subprocess.SubprocessError) as e:
                self.available, self.why = False, f"cannot set up the RAM device: {e}"
                self._tear_down()
            return self
        if self.name != "throttled":
            return self
        group = BLKIO_ROOT / f"fp_dcp_bench_{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            self.group = group
            (group / "blkio.throttle.read_iops_device").write_text(f"{self.dev} {self.iops}\n")
            (group / "blkio.throttle.write_iops_device").write_text(f"{self.dev} {self.iops}\n")
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as e:
            self.available, self.why = False, f"cannot set up {group}: {e}"
            self._tear_down()
        return self

    def _set_up_ram(self) -> None:
        for gone in reclaim_stale_ram():
            print(f"removed the RAM device of a benchmark process that is gone: {gone}")
        image, mount = ram_paths(os.getpid())
        fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._image = image
        try:
            # every page written now, not while the contenders write (pages
            # only fallocated were as slow to write through the loop device
            # the first time as pages not there: 0.4-2.5 GB/s instead of 3-4)
            zeros = bytes(16 * MiB)
            done = 0
            while done < self.fs_bytes:
                done += os.write(fd, zeros[: min(len(zeros), self.fs_bytes - done)])
        finally:
            os.close(fd)
        loop = _run_tool("losetup", "--find", "--show", str(image))
        # no discards: mkfs's and the file system's would give the pages back
        _run_tool("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", loop)
        mount.mkdir(mode=0o700)
        self._mount = mount
        _run_tool("mount", "-o", "nodiscard", loop, str(mount))
        self.directory = mount / "work"
        self.directory.mkdir()
        dev = disk_dev_of(self.directory)
        self.dev, self.disk = dev if dev else (None, None)
        self.max_sectors_kb = self._max_sectors_kb()

    def _tear_down(self) -> None:
        if self._image is not None:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
            try:
                # (children that just exited may still hold the file system for a moment)
                removed = _remove_ram(self._image, self._mount, tries=50)
            except OSError as e:
                removed = False
                print(f"warning: {e}")
            if not removed:  # all of it left for reclaim_stale_ram
                print(f"warning: the RAM device {self._image} (mounted at {self._mount}) stays; the first ram "
                      f"profile set up after this process has ended removes it")
            self._image = self._mount = self.directory = None
        if self.group is None:
            return
        try:
            (BLKIO_ROOT / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            pass
        for f in ("blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device"):
            try:
                (self.group / f).write_text(f"{self.dev} 0\n")
            except OSError:
                pass
        for _ in range(50):  # children that just exited may still be listed for a moment
            try:
                self.group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        self.group = None

    def __exit__(self, *exc: Any) -> None:
        self._tear_down()


def hardware_info(target_dir: str | Path) -> dict:
    from fp_dcp.tuning import machine

    cpu = machine()["cpu"]
    mem = meminfo("MemTotal")
    mnt, fstype, src = _mount_of(target_dir)
    info = {
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "ram_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "target_dir": str(target_dir),
        "mount_point": mnt,
        "fs_type": fstype,
        "mount_source": src,
        "block_device": block_device_of(target_dir),
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    fio = fio_path()
    if fio:
        try:
            info["fio"] = subprocess.run([fio, "--version"], capture_output=True,
                                         text=True).stdout.strip()
        except OSError:
            pass
    return info


def hardware_lines(hw: dict) -> list[str]:
    bd = hw.get("block_device", {})
    return [
        f"cpu: {hw['cpu_model']} x {hw['cpu_cores']} cores, RAM {fmt_size(hw['ram_bytes'] or 0)}, "
        f"kernel {hw['kernel']}, python {hw['python']}, torch {hw.get('torch', '?')}",
        f"target: {hw['target_dir']} on {hw['fs_type']} ({hw['mount_source']} mounted at "
        f"{hw['mount_point']}), block device {bd.get('disk', bd.get('name', '?'))}"
        + (f" model {bd['model']}" if bd.get("model") else "")
        + (f" rotational={bd['rotational']}" if "rotational" in bd else ""),
    ]


def check_free_space(path: str | Path, need_bytes: int) -> None:
    """Exit with a clear message if ``path`` has less than ``need_bytes`` free."""
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        sys.exit(f"error: {path} has {fmt_size(free)} free, this run needs {fmt_size(need_bytes)} "
                 "(3x the state dict). Pass --dir on a larger file system or a smaller --size.")


# --------------------------------------------------------------------------
# output


def summarize(values: Sequence[float]) -> dict:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)}


def fmt_num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 or not _numeric(c) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _numeric(s: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[0-9.]+x?|-", s))


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _json_default(o: Any):
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
