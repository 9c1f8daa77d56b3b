"""``fp-dcp verify PATH``: read every byte of a checkpoint and check every
checksum block; reports every problem, not only the first."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from fp_dcp import _native
from fp_dcp import format as fmt
from fp_dcp.checksums import BadBlock, ReadVerifier, item_name
from fp_dcp.engine import IOSession
from fp_dcp.files import lstat_data_file, read_metadata_bytes
from fp_dcp.options import FastPersistOptions, format_size, plural

__all__ = ["verify_checkpoint", "print_report", "VerifyReport", "BadExtent"]

_BATCH_BYTES = 64 << 20


@dataclasses.dataclass
class BadExtent:
    """An extent with at least one bad checksum block, or one that could not be read."""

    tensor: str
    path: str
    file_offset: int
    item_offset: int
    length: int
    reason: str
    bad_blocks: int = 0
    blocks: int = 0
    first_bad: int = -1  # file offset of the first bad checksum block
    first_actual: int = 0
    first_expected: int = 0

    def describe(self) -> str:
        return (
            f"{self.tensor}: file {self.path} offset {self.file_offset} length {self.length} "
            f"(bytes {self.item_offset}..{self.item_offset + self.length} of the item): {self.reason}"
        )


@dataclasses.dataclass
class VerifyReport:
    path: str
    extents: int = 0
    files: int = 0
    bytes: int = 0
    verified_bytes: int = 0
    unchecked_extents: int = 0  # written without checksums
    seconds: float = 0.0
    workers: int = 0
    bad: list[BadExtent] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # files missing, truncated, unreadable

    @property
    def ok(self) -> bool:
        return not self.bad and not self.errors

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    workers: int | None = None,
    options: FastPersistOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Read every extent of the checkpoint in ``path`` and check its checksums.
    Raises ``CheckpointFormatError`` / ``OSError`` only when the metadata
    itself cannot be read; every other problem goes in the report."""
    directory = os.fspath(path)
    t0 = time.perf_counter()
    meta_path = os.path.join(directory, fmt.METADATA_NAME)
    _, layout, _ = fmt.decode_metadata(read_metadata_bytes(directory), meta_path)
    paths = fmt.data_file_paths(directory, layout)
    report = VerifyReport(path=directory, files=len(paths))

    # per file: its extents (index, extent), by offset
    by_file: dict[int, list[tuple[Any, fmt.Extent]]] = {}
    for index, exts in layout.extents.items():
        for e in exts:
            report.extents += 1
            report.bytes += e.length
            if e.crc32c is None:
                report.unchecked_extents += 1
            by_file.setdefault(e.file, []).append((index, e))
    readable: list[int] = []
    for fid, (_name, size) in enumerate(layout.files):
        if fid not in by_file:
            continue
        try:
            actual = lstat_data_file(paths[fid]).st_size
        except fmt.CheckpointFormatError as e:
            report.errors.append(str(e))
            for index, ext in by_file[fid]:
                report.bad.append(_unreadable(index, ext, paths[fid], "data file is not a regular file"))
            continue
        except OSError as e:
            report.errors.append(f"{paths[fid]}: {e.strerror}")
            for index, ext in by_file[fid]:
                report.bad.append(_unreadable(index, ext, paths[fid], f"data file {(e.strerror or str(e)).lower()}"))
            continue
        if actual < size:
            report.errors.append(f"{paths[fid]}: truncated ({actual} bytes, the checkpoint recorded {size})")
            ok_exts = []
            for index, ext in by_file[fid]:
                if ext.file_offset + ext.length > actual:
                    why = f"beyond the end of the truncated file ({actual} bytes)"
                    report.bad.append(_unreadable(index, ext, paths[fid], why))
                else:
                    ok_exts.append((index, ext))
            by_file[fid] = ok_exts
        readable.append(fid)
    for fid in readable:
        by_file[fid].sort(key=lambda ie: ie[1].file_offset)

    opts = options if options is not None else FastPersistOptions.from_env()
    block = layout.checksum_block_bytes or (1 << 20)
    tasks = _tasks(readable, by_file, block)
    total = sum(t[2] for t in tasks)
    nworkers = max(1, workers or min(4, os.cpu_count() or 1, max(1, len(tasks))))
    report.workers = nworkers
    verifier = ReadVerifier(layout, paths)
    lock = threading.Lock()
    queue = iter(tasks)
    done = [0]

    stop = threading.Event()  # Ctrl-C: the workers finish their batch and take no other

    def next_task():
        with lock:
            return None if stop.is_set() else next(queue, None)

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    def work(_: int) -> tuple[int, list[BadExtent], list[str]]:
        return _worker(directory, opts, verifier, paths, next_task, tick)

    with concurrent.futures.ThreadPoolExecutor(nworkers, thread_name_prefix="fp_dcp-verify") as pool:
        try:
            for verified, bad, errors in pool.map(work, range(nworkers)):
                report.verified_bytes += verified
                report.bad.extend(bad)
                report.errors.extend(errors)
        except KeyboardInterrupt:
            stop.set()  # the pool's exit waits for the batches in flight only
            raise
    report.bad = _merge_bad(report.bad)
    report.seconds = time.perf_counter() - t0
    return report


def _unreadable(index: Any, e: fmt.Extent, path: str, reason: str) -> BadExtent:
    return BadExtent(item_name(index), path, e.file_offset, e.item_offset, e.length, reason)


def _tasks(fids, by_file, block):
    """Work for the workers: (file, pieces, bytes), each at most _BATCH_BYTES,
    a piece being (index, extent, offset in the extent, length), cut at
    checksum blocks; large files are shared by several workers."""
    step = max(block, _BATCH_BYTES // block * block)
    tasks = []
    for fid in fids:
        batch, nbytes = [], 0
        for index, e in by_file[fid]:
            rel = 0
            while True:
                n = min(step, e.length - rel)
                if batch and nbytes + n + 4096 > _BATCH_BYTES:
                    tasks.append((fid, batch, nbytes))
                    batch, nbytes = [], 0
                batch.append((index, e, rel, n))
                nbytes += n
                rel += n
                if rel >= e.length:
                    break
        if batch:
            tasks.append((fid, batch, nbytes))
    return tasks


def _worker(directory, opts, verifier, paths, next_task, tick):
    """One engine and one buffer; tasks until there are none left."""
    session = IOSession(opts, directory)
    align = session.alignment
    buf = _native.AlignedBuffer(_BATCH_BYTES + 64 * align, max(align, 4096), lock=False)
    mv = memoryview(buf)
    verified = 0
    bad: list[BadExtent] = []
    errors: list[str] = []
    fds: dict[int, int] = {}
    failed: set[int] = set()
    try:
        while (task := next_task()) is not None:
            fid, pieces, nbytes = task
            if fid in failed:
                continue
            try:
                fd = fds.get(fid)
                if fd is None:
                    fd = fds[fid] = session.engine.open(paths[fid], "r", session.direct or False)
            except OSError as e:
                failed.add(fid)
                errors.append(f"{paths[fid]}: {e}")
                why = f"cannot open: {e.strerror}"
                bad.extend(_unreadable(i, x, paths[fid], why) for i, x, r, _ in pieces if r == 0)
                continue
            pos, starts = 0, []
            for _, _, _, n in pieces:
                pos = -(-pos // align) * align
                starts.append(pos)
                pos += n
            views = [mv[s : s + p[3]] for p, s in zip(pieces, starts)]
            offs = np.array([p[1].file_offset + p[2] for p in pieces], dtype=np.int64)
            files = np.full(len(pieces), fid, dtype=np.int64)
            try:
                if verifier.enabled:
                    files, offs, views, check = verifier.plan(files, offs, views)
                    stats = session.engine.read([fd], [paths[fid]], np.zeros(len(views), np.int64), offs, views,
                                                coalesce_gap=0, **check.engine_kwargs)
                    v, blocks = check.compare(stats)
                    verified += v
                    bad.extend(_bad_extents(blocks, pieces, paths[fid], verifier.block))
                else:
                    session.engine.read([fd], [paths[fid]], np.zeros(len(views), np.int64), offs, views,
                                        coalesce_gap=0)
            except OSError as e:
                errors.append(f"{paths[fid]}: {e}")
                why = f"read failed: {e.strerror}"
                bad.extend(_unreadable(i, x, paths[fid], why) for i, x, r, _ in pieces if r == 0)
            finally:
                for view in views:
                    view.release()
            tick(nbytes)
    finally:
        for fd in fds.values():
            os.close(fd)
        mv.release()
        buf.close()
        session.close()
    return verified, bad, errors


def _merge_bad(bad: list[BadExtent]) -> list[BadExtent]:
    """One entry per extent (an extent read by several workers reports its
    bad blocks in several parts)."""
    out: dict[tuple[str, int], BadExtent] = {}
    for b in sorted(bad, key=lambda b: (b.path, b.file_offset, b.first_bad if b.bad_blocks else -1)):
        key = (b.path, b.file_offset)
        if key in out and out[key].bad_blocks and b.bad_blocks:
            out[key].bad_blocks += b.bad_blocks
        elif key not in out:
            out[key] = b
    for b in out.values():
        if b.bad_blocks:
            b.reason = (f"{b.bad_blocks} of {b.blocks} checksum block(s) bad; first: checksum mismatch at offset "
                        f"{b.first_bad} (crc32c {b.first_actual:08x}, stored {b.first_expected:08x})")
    return sorted(out.values(), key=lambda b: (b.path, b.file_offset))


def _bad_extents(blocks: list[BadBlock], pieces, path: str, block: int) -> list[BadExtent]:
    """Bad blocks grouped by extent."""
    out: dict[tuple[int, int], BadExtent] = {}
    for b in blocks:
        for index, ext, rel, n in pieces:
            if ext.file_offset + rel <= b.file_offset < ext.file_offset + rel + n:
                key = (ext.file, ext.file_offset)
                if key not in out:
                    out[key] = BadExtent(item_name(index), path, ext.file_offset, ext.item_offset, ext.length,
                                         "checksum mismatch", 0, fmt.checksum_blocks(ext.length, block),
                                         b.file_offset, b.actual, b.expected)
                out[key].bad_blocks += 1
                break
    return list(out.values())



def print_report(report: VerifyReport, *, as_json: bool = False) -> int:
    """Print ``report`` for people (or as JSON); the exit code: 0 when
    everything checked is good, else 1."""
    if as_json:
        print(json.dumps(report.as_dict(), indent=1))
        return 0 if report.ok else 1
    rate = report.bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
    print(
        f"{report.path}: {plural(report.extents, 'extent')}, {format_size(report.bytes, 1)} in "
        f"{plural(report.files, 'file')}, {plural(report.workers, 'worker')}, {report.seconds:.2f} s "
        f"({rate:.2f} GB/s); "
        f"{format_size(report.verified_bytes, 1)} checked against their CRC-32C"
    )
    if report.unchecked_extents:
        print(f"note: {plural(report.unchecked_extents, 'extent')} written without checksums: read, not checked")
    for err in report.errors:
        print(f"ERROR {err}")
    for b in report.bad:
        print(f"BAD {b.describe()}")
    if report.ok:
        print("OK")
        return 0
    print(f"{plural(len(report.bad), 'bad extent')}, {plural(len(report.errors), 'file error')}")
    return 1

