"""``fp-dcp tune PATH``: measure O_DIRECT writes and cold reads of a grid of
request sizes x queue depths through fp_dcp's engine and record a shape
(:mod:`fp_dcp.tuning`) when one clearly beats the built-in rule."""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Callable, Iterable

import numpy as np

from fp_dcp import _native, files, tuning
from fp_dcp.options import format_size, parse_size

__all__ = ["TuneError", "engine_pass", "fill_random", "parse_grid", "builtin_shapes", "cells", "measure", "choose",
           "format_tables", "run", "record"]

MiB = 1 << 20
DEFAULT_SIZES = (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB)
DEFAULT_DEPTHS = (4, 8, 16, 32)
DEFAULT_FILE_BYTES = 512 * MiB
DEFAULT_REPEAT = 3
# bytes in flight are bounce memory a load locks ((depth + 1) x request size)
DEFAULT_MAX_IN_FLIGHT = 64 * MiB
QUICK_SIZES = (1 * MiB, 4 * MiB)
QUICK_DEPTHS = (8,)
QUICK_FILE_BYTES = 64 * MiB
MARGIN = 0.10  # how much faster than the built-in shape a cell must be to replace it
BUFFER_BYTES = 128 * MiB  # the page-locked memory the passes move to and from
_CALL_BYTES = 1 << 30  # bytes per engine call (between two calls the queue drains once)


class TuneError(ValueError):
    """An argument or a directory ``fp-dcp tune`` cannot work with; the message
    names the fix."""


# ------------------------------------------------------------------ one pass


def engine_pass(op: str, path: str, nbytes: int, block_size: int, queue_depth: int, *,
                buffer: Any = None, kind: str = "auto", direct: bool | None = True, rewrite: bool = False) -> dict:
    """A sequential ``op`` ("write": a new file, fsync in the clock; "read") of
    ``nbytes`` at ``path`` through fp_dcp's engine, to / from one aligned,
    page-locked ``buffer`` reused for every piece.  ``rewrite``: the write
    goes over the blocks of the existing file at ``path`` (not truncated, as
    a recycled save writes).  Returns ``{"op", "bytes", "seconds", "kind",
    "block_size", "queue_depth", "direct"}``."""
    if op not in ("write", "read"):
        raise ValueError(f"op must be write or read, not {op!r}")
    own = buffer is None
    if own:
        buffer = _native.AlignedBuffer(min(BUFFER_BYTES, max(nbytes, block_size)), 4096)
        fill_random(buffer)
    span = len(buffer)
    try:
        with _native.Engine(kind, queue_depth=queue_depth, block_size=block_size) as eng:
            if rewrite and op == "write":
                with files.Root(os.path.dirname(os.path.abspath(path))) as d:
                    fd = d.open_fd(os.path.basename(path), os.O_WRONLY | (os.O_DIRECT if direct is not False else 0))
            else:
                fd = eng.open(path, "w" if op == "write" else "r", direct)
            try:
                is_direct = _native.Engine.is_direct(fd)
                if op == "read" and not is_direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                views = [memoryview(buffer)[: min(span, nbytes - off)] for off in range(0, nbytes, span)]
                per_call = max(1, _CALL_BYTES // span)
                part = args = None
                try:
                    t0 = time.perf_counter()
                    for first in range(0, len(views), per_call):
                        part = views[first:first + per_call]
                        offsets = np.arange(first, first + len(part), dtype=np.int64) * span
                        args = ([fd], [path], np.zeros(len(part), np.int64), offsets, part)
                        if op == "write":
                            eng.write(*args, sync=False)
                        else:
                            eng.read(*args, coalesce_gap=0)
                    if op == "write":
                        os.fsync(fd)
                    seconds = time.perf_counter() - t0
                finally:  # else closing the buffer would hide the engine's error
                    del part, args
                    for v in views:
                        v.release()
                if op == "write":  # a read of it must come from the device
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            engine_kind = eng.kind
    finally:
        if own:
            buffer.close()
    return {"op": op, "bytes": nbytes, "seconds": seconds, "kind": engine_kind,
            "block_size": block_size, "queue_depth": queue_depth, "direct": is_direct}


def fill_random(buffer: Any) -> None:
    """Random bytes in ``buffer`` (a 1 MiB random pattern, repeated)."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    pattern = np.random.default_rng(0).integers(0, 256, min(MiB, len(view)), dtype=np.uint8)
    whole = len(view) // len(pattern) * len(pattern)
    view[:whole].reshape(-1, len(pattern))[:] = pattern
    view[whole:] = pattern[: len(view) - whole]


# ------------------------------------------------------------------ the grid


def parse_grid(sizes: str | None, depths: str | None, quick: bool = False) -> tuple[list[int], list[int]]:
    """``"256K,1M,4M"`` and ``"4,8,16"`` (or the defaults) as sorted lists."""
    try:
        s = (sorted({parse_size(x) for x in sizes.split(",")}) if sizes
             else list(QUICK_SIZES if quick else DEFAULT_SIZES))
    except ValueError as e:
        raise TuneError(f"--sizes {sizes!r}: {e}, comma-separated: --sizes 256K,1M,4M") from None
    bad = [x for x in s if x <= 0 or x % 4096 or x > 1 << 30]
    if bad:
        raise TuneError(f"--sizes {sizes!r}: a request size must be a multiple of 4 KiB up to 1 GiB, "
                        f"not {format_size(bad[0])}; e.g. --sizes 256K,1M,4M")
    try:
        d = (sorted({int(x) for x in depths.split(",")}) if depths
             else list(QUICK_DEPTHS if quick else DEFAULT_DEPTHS))
    except ValueError:
        raise TuneError(f"--depths {depths!r}: expected whole numbers separated by commas, "
                        f"e.g. --depths 4,8,16") from None
    if any(not 1 <= x <= 4096 for x in d):
        raise TuneError(f"--depths {depths!r}: a queue depth is from 1 to 4096; e.g. --depths 4,8,16")
    return s, d


def builtin_shapes(directory: str) -> dict[str, tuning.Shape]:
    """The shapes fp_dcp uses on ``directory``'s device from this process
    without a record: the writer's rule for writes, the reader's for long runs."""
    from fp_dcp.engine import read_shape, write_shape

    return {"write": tuning.Shape(*write_shape(directory, 4096)), "read": tuning.Shape(*read_shape(directory, 4096))}


def cells(sizes: Iterable[int], depths: Iterable[int], max_in_flight: int,
          must: Iterable[tuning.Shape] = ()) -> list[tuning.Shape]:
    """The grid's (request size, depth) cells with at most ``max_in_flight``
    bytes in flight, and the ``must`` shapes (the built-in ones) in any case."""
    grid = {tuning.Shape(s, d) for s in sizes for d in depths if s * d <= max_in_flight}
    return sorted(grid | set(must))


def check_directory(directory: str, file_bytes: int) -> None:
    """Raise :class:`TuneError` unless ``directory`` can hold the scratch
    file and takes O_DIRECT."""
    if not os.path.isdir(directory):
        what = "a file" if os.path.exists(directory) else "nothing"
        raise TuneError(f"{directory}: {what} there, not a directory; give a directory on the file system "
                        f"to measure (the checkpoints' parent directory)")
    try:
        direct = _native.direct_io_supported(directory)
    except OSError as e:
        raise TuneError(f"{directory}: cannot write a probe file here ({e.strerror}); "
                        f"give a directory you can write to") from None
    if not direct:
        raise TuneError(f"{directory}: the file system refuses O_DIRECT (tmpfs, some network file systems), "
                        f"so fp_dcp moves its files through the page cache and there is no device to tune")
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < file_bytes + 64 * MiB:
        raise TuneError(f"{directory}: {format_size(st.f_bavail * st.f_frsize)} free, the measurement needs "
                        f"{format_size(file_bytes)}; pass a smaller --file-size")


def measure(directory: str, shapes: list[tuning.Shape], file_bytes: int, *, repeat: int = DEFAULT_REPEAT,
            progress: Callable[[int, int], None] | None = None) -> dict[str, dict[tuning.Shape, list[float]]]:
    """GB/s of each shape in each of ``repeat`` rounds (``{"write": {shape:
    [GB/s, ...]}, "read": {...}}``), alternate rounds in reverse order; the
    scratch file is removed at the end, also on errors and Ctrl-C."""
    root = files.Root(directory)
    name = f".fp_dcp-tune-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    os.close(root.create_exclusive(name))  # a new regular file: nothing planted at the name is opened
    path = root.join(name)
    total = 2 * file_bytes * len(shapes) * repeat
    done = 0
    out: dict[str, dict[tuning.Shape, list[float]]] = {"write": {}, "read": {}}
    buffer = _native.AlignedBuffer(min(BUFFER_BYTES, file_bytes), 4096)
    try:
        fill_random(buffer)
        for rnd in range(repeat):
            for shape in (shapes if rnd % 2 == 0 else shapes[::-1]):
                for op in ("write", "read"):
                    r = engine_pass(op, path, file_bytes, shape.block_size, shape.queue_depth, buffer=buffer)
                    out[op].setdefault(shape, []).append(r["bytes"] / r["seconds"] / 1e9)
                    done += file_bytes
                    if progress is not None:
                        progress(done, total)
    finally:
        buffer.close()
        with root:
            root.unlink(name)
    return out


def mean(samples: list[float]) -> float:
    return sum(samples) / len(samples)


def choose(samples: dict[tuning.Shape, list[float]], builtin: tuning.Shape, margin: float = MARGIN) -> tuning.Shape:
    """The built-in shape, unless some cells beat it by more than ``margin`` in
    every round (the disk swings from minute to minute, so a smaller or one-off
    win is noise); then the fastest of them on average."""
    if builtin not in samples:
        return max(samples, key=lambda s: mean(samples[s]))
    base = samples[builtin]
    better = [s for s, g in samples.items() if all(x > b * (1 + margin) for x, b in zip(g, base))]
    if not better:
        return builtin
    return max(better, key=lambda s: (mean(samples[s]), -s.block_size * s.queue_depth))


# ------------------------------------------------------------------ printing


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % MiB == 0 else f"{n >> 10} KiB"


def format_tables(result: dict[str, Any]) -> str:
    """The grids as tables (request size down, queue depth across, GB/s),
    like DeepSpeed's ds_nvme_tune: ``*`` the fastest, ``=`` the built-in
    rule, ``[ ]`` the choice; then the choice in words."""
    lines = []
    for op in ("write", "read"):
        grid = {tuning.Shape(c["block_size_bytes"], c["queue_depth"]): c["gbps"] for c in result["grid"][op]}
        chosen = tuning.Shape(result["chosen"][op]["block_size_bytes"], result["chosen"][op]["queue_depth"])
        builtin = tuning.Shape(result["builtin"][op]["block_size_bytes"], result["builtin"][op]["queue_depth"])
        best = max(grid, key=lambda s: grid[s])
        sizes = sorted({s.block_size for s in grid})
        depths = sorted({s.queue_depth for s in grid})
        what = ("new file, fsync in the clock" if op == "write" else "cold: O_DIRECT, file dropped from the page cache")
        lines.append(f"{op} GB/s ({format_size(result['file_bytes'])} per cell, {what})")
        lines.append(f"  {'request  depth':<16}" + "".join(f"{d:>9}" for d in depths))
        for s in sizes:
            row = f"  {_size(s):<16}"
            for d in depths:
                shape = tuning.Shape(s, d)
                if shape not in grid:
                    row += f"{'-':>9}"
                    continue
                mark = ("*" if shape == best else "") + ("=" if shape == builtin else "")
                cell = f"{grid[shape]:.2f}{mark}"
                row += f"{'[' + cell + ']' if shape == chosen else cell:>9}"
            lines.append(row)
        lines.append("")
    lines.append("  * fastest   = built-in rule   [ ] chosen")
    for op in ("write", "read"):
        c, b = result["chosen"][op], result["builtin"][op]
        how = ("the built-in rule (no cell beats it by more than "
               f"{100 * result['margin']:.0f} %)" if c == b else
               f"instead of the built-in {_size(b['block_size_bytes'])} x {b['queue_depth']}")
        lines.append(f"  {op:<5}: {_size(c['block_size_bytes'])} requests x {c['queue_depth']} in flight, {how}")
    return "\n".join(lines)


def run(directory: str, *, sizes: list[int], depths: list[int], file_bytes: int,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, repeat: int = DEFAULT_REPEAT, margin: float = MARGIN,
        progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Measure ``directory``'s device and choose; the result as plain data
    (JSON-ready), nothing recorded."""
    file_bytes = -(-file_bytes // max(sizes)) * max(sizes)
    check_directory(directory, file_bytes)
    builtin = builtin_shapes(directory)
    shapes = cells(sizes, depths, max_in_flight, builtin.values())
    t0 = time.perf_counter()
    samples = measure(directory, shapes, file_bytes, repeat=repeat, progress=progress)
    chosen = {op: choose(samples[op], builtin[op], margin) for op in ("write", "read")}

    def shape(s: tuning.Shape) -> dict[str, int]:
        return {"block_size_bytes": s.block_size, "queue_depth": s.queue_depth}

    return {
        "path": os.path.abspath(directory),
        "device": tuning.device_identity(directory),
        "machine": tuning.machine(),
        "file_bytes": file_bytes,
        "repeat": repeat,
        "margin": margin,
        "seconds": round(time.perf_counter() - t0, 1),
        "grid": {op: [dict(shape(s), gbps=round(mean(g), 3), rounds=[round(x, 3) for x in g])
                      for s, g in sorted(samples[op].items())] for op in samples},
        "builtin": {op: shape(s) for op, s in builtin.items()},
        "chosen": {op: shape(s) for op, s in chosen.items()},
    }


def record(directory: str, result: dict[str, Any], path: str | None = None) -> str:
    """Store ``result``'s choice for the device (see :func:`fp_dcp.tuning.store`)."""
    def shape(op: str) -> tuning.Shape:
        c = result["chosen"][op]
        return tuning.Shape(c["block_size_bytes"], c["queue_depth"])

    measured = {k: result[k] for k in ("file_bytes", "repeat", "margin", "grid", "builtin")}
    return tuning.store(directory, shape("write"), shape("read"), measured, path)
