"""A save's commit protocol, and the clean-up around it.

A save becomes visible at one point: the rename of its temporary metadata
over ``.fp_dcp.meta`` (:func:`commit_metadata`).  Until then the coordinator
holds the checkpoint directory's lock (:class:`SaveLock`), so two saves into
one directory never interleave, and the previous checkpoint stays whole.
With ``options.sync_files`` the directory is synced before the rename (the
new data files' entries reach the disk first: a crash never leaves committed
metadata naming lost files) and after it.

What a failure or a crash leaves behind before the rename is garbage:
:func:`abandon_rank_files` removes a rank's data files when its write failed,
:func:`commit_metadata` removes the temporary metadata and the new data files
when the commit itself failed, and :func:`remove_superseded` (after the next
commit) removes whatever else is left: the data files of earlier saves and
stale temporary metadata.

Every ``os`` call of the commit protocol goes through this module's ``os``:
the crash tests (``tests/_crash.py``) replace it to kill the coordinator just
before the k-th ``open``, ``write``, ``fsync``, ``replace`` or ``unlink``.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from typing import Iterable

from fp_dcp import format as fmt

__all__ = ["SaveLock", "sync_directory", "commit_metadata", "remove_superseded", "abandon_rank_files"]


class SaveLock:
    """The coordinator's exclusive ``flock`` on the checkpoint directory's
    lock file, from ``prepare_global_plan`` to the end of ``finish`` (or the
    failure).  Taken without waiting: a second save into the directory fails
    at once with a message, it does not queue behind the first.  Rotation
    (:mod:`fp_dcp.tools.rotation`) takes the same lock before it removes a
    checkpoint, and skips one whose save holds it."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def acquire(self, directory: str) -> None:
        if not self.try_acquire(directory):
            raise BlockingIOError(
                11, "another fp_dcp save into this checkpoint directory is in progress; wait for it "
                "or save elsewhere", directory
            )

    def try_acquire(self, directory: str) -> bool:
        """Take the lock unless another holder has it (then False).  The
        lock file is never followed if it is a link (``O_NOFOLLOW``)."""
        if self.fd is not None:
            return True
        path = os.path.join(directory, fmt.LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        # a writer dropped after a failed save (DCP never calls finish) must not keep the lock
        self._finalizer = weakref.finalize(self, os.close, fd)
        return True

    def release(self) -> None:
        if self.fd is not None:
            self._finalizer()  # closes the fd, once
            self.fd = None

    def __reduce__(self) -> tuple:
        # The lock belongs to the process that took it: a copy (a writer
        # pickled for a checkpoint process) holds none.
        return (SaveLock, ())


def sync_directory(directory: str) -> None:
    """``fsync`` a directory: the entries made or renamed in it reach the disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_metadata(directory: str, blob: bytes, save_id: str, data_files: Iterable[str], sync: bool) -> None:
    """Write ``blob`` as the checkpoint's metadata: to a temporary name
    (``.fp_dcp.meta.<save_id>.tmp``), then renamed over ``.fp_dcp.meta`` (the
    commit point).  ``data_files`` (names in ``directory``, or absolute paths
    in data directories) are the new save's data files: if the commit fails
    before the rename, nothing refers to them or to the temporary file, and
    both are removed.  ``sync``: fsync the file and the directory."""
    final = os.path.join(directory, fmt.METADATA_NAME)
    tmp = f"{final}.{save_id}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        _abandon_commit(directory, tmp, data_files)
        if isinstance(e, OSError) and e.filename is None:  # os.write/fsync name no file
            raise type(e)(e.errno, f"cannot write the checkpoint metadata: {e.strerror}", tmp) from None
        raise
    os.close(fd)
    if sync:
        # the data files' and the temporary metadata's entries reach the
        # disk before the rename can: a crash never leaves a committed
        # metadata file whose data files' names were lost
        sync_directory(directory)
    try:
        os.replace(tmp, final)  # the commit point
    except BaseException:
        _abandon_commit(directory, tmp, data_files)
        raise
    if sync:
        sync_directory(directory)


def _abandon_commit(directory: str, tmp: str, data_files: Iterable[str]) -> None:
    for name in [tmp] + [os.path.join(directory, n) for n in data_files]:
        try:
            os.unlink(name)
        except OSError:
            pass


def remove_superseded(directory: str, data_directories: list[tuple[str, bool]], files: list[str]) -> None:
    """After the commit: remove what the committed checkpoint (its data
    ``files``, as recorded in the metadata) does not use, in the checkpoint
    directory and in this checkpoint's sub-directories of the data
    directories (``data_directories``: ``(directory, named by absolute
    path)``): data files of earlier saves and leftover temporary metadata
    (a crash before a commit leaves them)."""
    _remove_stale(directory, set(files))
    for data_dir, by_path in data_directories:
        if by_path and os.path.isdir(data_dir):
            _remove_stale(data_dir, {os.path.basename(n) for n in files if os.path.dirname(n) == data_dir})


def _remove_stale(directory: str, keep: set[str]) -> None:
    for entry in os.scandir(directory):
        n = entry.name
        stale_data = n.endswith(fmt.DATA_SUFFIX) and n not in keep
        stale_tmp = n.startswith(fmt.METADATA_NAME + ".") and n.endswith(".tmp")
        if stale_data or stale_tmp:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass


def abandon_rank_files(data_directories: list[tuple[str, bool]], save_id: str, rank: int) -> None:
    """After rank ``rank`` failed to write its part of save ``save_id``:
    remove the data files it created (a full disk gets its space back); the
    previous checkpoint was never touched."""
    prefix = f"{save_id}.r{rank}."
    for directory, _ in data_directories:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(prefix) and entry.name.endswith(fmt.DATA_SUFFIX):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
