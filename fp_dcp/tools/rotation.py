"""Checkpoint rotation: keep the newest N checkpoints of a run.

A training loop that saves every K steps into ``root/step<N>`` calls
``keep_last(root, 3)`` after each save::

    dcp.save(state, storage_writer=writer, checkpoint_id=f"{root}/step{step:06d}")
    fp_dcp.tools.rotation.keep_last(root, 3)

Only committed fp_dcp checkpoints (directories holding ``.fp_dcp.meta``)
directly under ``root`` count and are removed, oldest commit first.  A
directory whose save is in progress (its ``.fp_dcp.lock`` is held) is never
touched, nor is anything without metadata (an interrupted save: load it to
see why, remove it by hand).  A checkpoint's data files in data directories
(``FastPersistOptions.data_dirs``) are removed with it — only those its
metadata names by the writer's rule in this checkpoint's own sub-directory of
a data directory (``docs/FORMAT.md``, "Files"): crafted metadata cannot make
rotation delete anything else.  A symbolic link under ``root`` is never
followed.
"""

from __future__ import annotations

import os
import shutil
import stat

from fp_dcp import format as fmt
from fp_dcp.files import lstat_data_file, read_metadata_bytes
from fp_dcp.save.commit import SaveLock

__all__ = ["keep_last", "committed_checkpoints"]



def committed_checkpoints(root: str | os.PathLike) -> list[str]:
    """Committed checkpoint directories directly under ``root``, oldest commit first."""
    found = []
    with os.scandir(root) as it:
        for entry in it:
            if not entry.is_dir(follow_symlinks=False):
                continue
            try:
                st = os.lstat(os.path.join(entry.path, fmt.METADATA_NAME))
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # fp_dcp writes a regular file: anything else is not one of its checkpoints
            found.append((st.st_mtime_ns, entry.name, entry.path))
    found.sort()
    return [p for _, _, p in found]


def keep_last(root: str | os.PathLike, n: int) -> list[str]:
    """Remove all but the ``n`` newest committed checkpoints under ``root``;
    returns the directories removed."""
    if n < 1:
        raise ValueError(f"keep_last needs n >= 1, got {n}")
    removed = []
    for path in committed_checkpoints(root)[:-n]:
        if _remove_checkpoint(path):
            removed.append(path)
    return removed


def _remove_checkpoint(path: str) -> bool:
    """Remove one checkpoint under its own lock (skipped while a save holds it)."""
    lock = SaveLock()
    try:
        if not lock.try_acquire(path):
            return False
    except OSError:
        return False
    try:
        meta = os.path.join(path, fmt.METADATA_NAME)
        external: list[str] = []
        try:
            _, layout, _ = fmt.decode_metadata(read_metadata_bytes(path), meta)
            # only files proven to lie in this checkpoint's own sub-directory
            # of a data directory (the writer's naming rule, checked here)
            paths = fmt.data_file_paths(path, layout)  # every name confined, or it raises
            external = [p for (name, _), p in zip(layout.files, paths) if "/" in name]
        except (OSError, fmt.CheckpointFormatError):
            pass  # damaged or crafted metadata: remove only what is in the directory
        os.unlink(meta)  # no longer committed: nothing will load it half removed
        for name in external:
            try:
                lstat_data_file(name)  # a regular file, in a sub-directory that is no link
                os.unlink(name)
            except (OSError, fmt.CheckpointFormatError):
                pass
        for d in {os.path.dirname(name) for name in external}:
            try:
                os.rmdir(d)  # the checkpoint's sub-directory of a data directory, when empty
            except OSError:
                pass
        shutil.rmtree(path)
        return True
    finally:
        lock.release()
