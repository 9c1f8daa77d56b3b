"""Checkpoint rotation (``keep_last(root, 3)``): only committed, unlocked fp_dcp
checkpoints directly under ``root`` are removed, oldest first, with only the
files the writer's naming rule gives them; links are never followed."""

from __future__ import annotations

import os
import stat

from fp_dcp import format as fmt
from fp_dcp.files import Root, UnsafePathError, lstat_data_file, read_metadata_bytes
from fp_dcp.save.commit import SaveLock

__all__ = ["keep_last", "committed_checkpoints"]


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
            external: list[str] = []
            named: set[str] = set()
            try:
                _, layout, _ = fmt.decode_metadata(read_metadata_bytes(ck), ck.join(fmt.METADATA_NAME))
                # only files proven to lie in this checkpoint's own sub-directory
                # of a data directory (the writer's naming rule, checked here)
                paths = fmt.data_file_paths(ck.path, layout)  # every name confined, or it raises
                external = [p for (f, _), p in zip(layout.files, paths) if "/" in f]
                named = {f for f, _ in layout.files if "/" not in f}
            except (OSError, fmt.CheckpointFormatError):
                pass  # damaged or crafted metadata: remove only fp_dcp's own names in the directory
            ck.unlink(fmt.METADATA_NAME)  # no longer committed: nothing will load it half removed
            _remove_external(external)
            r.remove_owned(name, lambda rel, kind: kind in ("file", "link") and _own_name(rel, named))
            return True
        finally:
            lock.release()


def _own_name(name: str, named: set[str]) -> bool:
    """A name fp_dcp writes in a checkpoint directory: a data file (this
    checkpoint's or an earlier save's), the metadata, its temporaries, the lock."""
    return (name in named or name == fmt.LOCK_NAME or name.startswith(fmt.METADATA_NAME)
            or fmt.valid_data_file_name(name))


def _remove_external(external: list[str]) -> None:
    """The checkpoint's data files in its sub-directories of data directories
    (regular files, in a sub-directory that is no link), then each such
    sub-directory when empty."""
    for path in external:
        try:
            lstat_data_file(path)
            with Root(os.path.dirname(path), follow=False) as d:
                d.unlink(os.path.basename(path))
        except (OSError, fmt.CheckpointFormatError):
            pass
    for sub in {os.path.dirname(p) for p in external}:
        try:
            with Root(os.path.dirname(sub)) as parent:
                parent.rmdir(os.path.basename(sub))  # only when empty; a link is not a directory
        except OSError:
            pass
