"""The tiers' directories on disk: where each step lives, what a directory
holds, atomic small writes, retention.

Layout (``docs/TIERS.md``)::

    <local root of node n>/step_<step>/      one fp_dcp checkpoint directory per step:
        .fp_dcp.meta                          the metadata (the commit point), on every node
        <save_id>.r<rank>.0.fpd               data files of node n's own ranks
        <save_id>.r<rank>.0.fpd               ... and replicas of the nodes n holds for
    <local root>/.restore/                    a restore being assembled (removed after it)
    <persistent root>/step_<step>/            a plain fp_dcp checkpoint (every file of the step)

A step directory is a normal fp_dcp checkpoint directory: the metadata
and the data files are what ``FastPersistWriter`` wrote; replicas keep the
writer's names, so ``FastPersistReader``'s confinement rule (only this
save's names, no links) holds everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Iterator

from fp_dcp import format as fmt
from fp_dcp.files import read_metadata_bytes
from fp_dcp.save.commit import sync_directory

__all__ = ["step_dir", "node_root", "Holding", "scan", "write_atomic", "RangesFile", "retain", "RESTORE_DIR"]

_STEP = re.compile(r"step_(\d{1,18})")
RESTORE_DIR = ".restore"
TMP_SUFFIX = ".tier-tmp"  # a file being written: never taken for a data file


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def node_root(template: str, node: int) -> str:
    """A node's local root: ``template`` with ``{node}`` replaced (tests and
    single-machine runs give each node its own directory); on a cluster the
    same path on every node."""
    return template.replace("{node}", str(node))


def steps(root: str) -> Iterator[tuple[int, str]]:
    """``(step, directory)`` of every step directory under ``root``."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for e in entries:
        m = _STEP.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False):
            yield int(m.group(1)), e.path


@dataclasses.dataclass
class Holding:
    """What one directory holds of one step: the metadata's save id and file
    list (when the metadata is there) and the data files present, by size."""

    save_id: str | None
    meta_files: list[tuple[str, int]] | None
    files: dict[str, int]


def decode(blob: bytes, where: str) -> tuple:
    """A step's metadata decoded (:func:`fp_dcp.format.decode_metadata`),
    with the tiers' confinement rule on top: every data file is a plain name
    the writer gives this save (no path, no data directory), so nothing a
    tier copies, links, sends, receives or deletes lies outside a step
    directory, whatever a crafted metadata names.  Every place the tiers read
    a metadata (a local or persistent step, one sent by a peer) goes
    through here."""
    metadata, layout, extra = fmt.decode_metadata(blob, where)
    for name, _ in layout.files:
        if "/" in name or not fmt.valid_data_file_name(name, layout.save_id):
            raise fmt.CheckpointFormatError(
                f"{where}: data file {name!r} is not a plain file name of save {layout.save_id!r}; the tiers hold "
                f"checkpoints saved by TierManager (no data_dirs): this one was crafted or saved another way")
    return metadata, layout, extra


def scan(root: str) -> dict[int, Holding]:
    """Every step directory under ``root``: its metadata (decoded, checked)
    and its data files.  A damaged metadata counts as absent."""
    out: dict[int, Holding] = {}
    for step, path in steps(root):
        files = {}
        for e in os.scandir(path):
            if e.name.endswith(fmt.DATA_SUFFIX) and e.is_file(follow_symlinks=False):
                files[e.name] = e.stat(follow_symlinks=False).st_size
        save_id = meta_files = None
        try:
            blob = read_metadata_bytes(path)
            _, layout, _ = decode(blob, os.path.join(path, fmt.METADATA_NAME))
            save_id, meta_files = layout.save_id, [(n, s) for n, s in layout.files]
        except (OSError, fmt.CheckpointFormatError):
            pass
        out[step] = Holding(save_id, meta_files, files)
    return out


def write_atomic(path: str, data: bytes | memoryview, sync: bool = True) -> None:
    """``data`` at ``path``, all or nothing: a temporary beside it, synced,
    renamed over it, the directory synced."""
    tmp = path + TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync:
        sync_directory(os.path.dirname(path) or ".")


class RangesFile:
    """A file of ``size`` bytes created at ``path`` (never over an existing
    entry: a name taken, by a link to a local copy say, is an error), holes
    everywhere, then written range by range (:meth:`write`); :meth:`close`
    when every range is written, :meth:`discard` removes it.  Not synced: a
    restore's scratch, which the restore reads only once every range
    written was checked (``docs/TIERS.md``)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            self.discard()
            raise

    def write(self, ranges, data) -> None:
        """``data``: the bytes of ``ranges`` (``(offset, length)`` pairs),
        concatenated."""
        if self.fd is None:
            raise ValueError(f"{self.path}: closed")
        view = memoryview(data).cast("B")
        at = 0
        for off, n in ranges:
            if off < 0 or off + n > self.size:
                raise ValueError(f"{self.path}: range {off}+{n} outside the file's {self.size} bytes")
            w = 0
            while w < n:
                w += os.pwrite(self.fd, view[at + w: at + n], off + w)
            at += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def discard(self) -> None:
        self.close()
        _unlink(self.path)


def retain(root: str, keep: int, pinned: set[int] = frozenset(), newest: int | None = None) -> list[str]:
    """Keep the ``keep`` newest steps under ``root`` that have metadata;
    remove every older step directory (committed or not) except the
    ``pinned`` ones (a drain still reads them).  Steps newer than the
    oldest kept one stay, committed or not (a save in progress).  Metadata
    first, so nothing half removed is ever taken for a step.  ``newest``:
    steps after it do not count as committed (saved, not yet replicated)."""
    if keep < 1:
        raise ValueError(f"retention keeps at least 1 step, got {keep}")
    held = sorted(steps(root))
    committed = [s for s, p in held if os.path.lexists(os.path.join(p, fmt.METADATA_NAME))
                 and (newest is None or s <= newest)]
    if len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    removed = []
    for step, path in held:
        if step < oldest_kept and step not in pinned:
            remove_step(path)
            removed.append(path)
    return removed


def remove_step(path: str) -> None:
    _unlink(os.path.join(path, fmt.METADATA_NAME))
    shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
