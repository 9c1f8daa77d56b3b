"""Checkpoint rotation (``keep_last(root, 3)``): only committed, unlocked fp_dcp
checkpoints directly under ``root`` are removed, oldest first, with only the
files the writer's naming rule gives them; links are never followed."""

from __future__ import annotations

import os
import stat

from fp_dcp import format as fmt
from fp_dcp.files import Root, UnsafePathError, read_metadata_bytes
from fp_dcp.save.commit import SaveLock, remove_checkpoint_files

__all__ = ["keep_last", "committed_checkpoints", "to_recycle"]


def committed_checkpoints(root: str | os.PathLike) -> list[str]:
    """Committed checkpoint directories directly under ``root``, oldest commit first."""
    with Root(root) as r:
        return [os.path.join(os.fspath(root), name) for name in _committed(r)]


def _committed(r: Root) -> list[str]:
    found = []
    for name, kind in r.entries():
        if kind != "dir":
            continue  # a link is never followed
        try:
            st = r.lstat(f"{name}/{fmt.METADATA_NAME}")
        except (FileNotFoundError, UnsafePathError):
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # fp_dcp writes a regular file: anything else is not one of its checkpoints
        found.append((st.st_mtime_ns, name))
    found.sort()
    return [name for _, name in found]


def to_recycle(root: str | os.PathLike, keep: int) -> str | None:
    """The committed checkpoint under ``root`` that the next save there should
    recycle (``FastPersistWriter(path, recycle=...)``) so that ``keep`` remain
    after it: the oldest, where there are ``keep`` or more; else None."""
    if keep < 1:
        raise ValueError(f"to_recycle needs keep >= 1, got {keep}")
    found = committed_checkpoints(root) if os.path.isdir(root) else []
    return found[0] if len(found) >= keep else None


def keep_last(root: str | os.PathLike, n: int) -> list[str]:
    """Remove all but the ``n`` newest committed checkpoints under ``root``;
    returns the directories removed.  Only fp_dcp's own files are removed
    from a checkpoint directory: one that holds anything else keeps it (and
    stays, no longer a checkpoint)."""
    if n < 1:
        raise ValueError(f"keep_last needs n >= 1, got {n}")
    removed = []
    with Root(root) as r:
        for name in _committed(r)[:-n]:
            if _remove_checkpoint(r, name):
                removed.append(os.path.join(os.fspath(root), name))
    return removed


def _remove_checkpoint(r: Root, name: str) -> bool:
    """Remove one checkpoint under its own lock (skipped while a save holds it)."""
    try:
        ck = r.sub(name)  # a directory swapped for a link since the listing: refused
    except OSError:
        return False
    with ck:
        lock = SaveLock()
        try:
            if not lock.try_acquire(ck):
                return False
        except OSError:
            return False
        try:
            try:
                layout = fmt.decode_metadata(read_metadata_bytes(ck), ck.join(fmt.METADATA_NAME))[1]
            except (OSError, fmt.CheckpointFormatError):
                layout = None  # damaged or crafted metadata: remove only fp_dcp's own names in the directory
            ck.unlink(fmt.METADATA_NAME)  # no longer committed: nothing will load it half removed
            remove_checkpoint_files(r, name, ck.path, layout)
            return True
        finally:
            lock.release()
