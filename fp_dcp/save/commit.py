"""A save's commit (the rename over ``.fp_dcp.meta``, under :class:`SaveLock`) and
the clean-up of what failures leave, through :mod:`fp_dcp.files`
(docs/FORMAT.md, "Commit protocol")."""

from __future__ import annotations

import fcntl
import os
import stat
import weakref
from typing import Iterable

from fp_dcp import files
from fp_dcp import format as fmt

__all__ = ["SaveLock", "sync_directory", "commit_metadata", "remove_superseded", "abandon_rank_files",
           "remove_checkpoint_files"]


class SaveLock:
    """The coordinator's exclusive ``flock`` on the checkpoint directory, from
    ``prepare_global_plan`` to the end of ``finish``; taken without waiting (a
    second save fails at once).  Rotation takes it too."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def acquire(self, directory: "str | files.Root") -> None:
        if not self.try_acquire(directory):
            raise BlockingIOError(
                11, "another fp_dcp save into this checkpoint directory is in progress; wait for it "
                "or save elsewhere", getattr(directory, "path", directory)
            )

    def try_acquire(self, directory: "str | files.Root") -> bool:
        """Take the lock unless another holder has it (then False).  The
        lock file is never followed if it is a link, nor is a FIFO opened."""
        if self.fd is not None:
            return True
        if isinstance(directory, files.Root):
            fd = _open_lock(directory)
        else:
            with files.Root(directory) as root:
                fd = _open_lock(root)
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


def _open_lock(root: files.Root) -> int:
    fd = root.open_fd(fmt.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise files.NotRegularFileError(22, "the lock file is not a regular file; fp_dcp makes a regular "
                                        "one: remove it", root.join(fmt.LOCK_NAME))
    return fd


def sync_directory(directory: str) -> None:
    """``fsync`` a directory: the entries made or renamed in it reach the disk."""
    with files.Root(directory) as root:
        root.sync()


def commit_metadata(root: files.Root, blob: bytes, save_id: str, data_files: Iterable[str], sync: bool) -> None:
    """Write ``blob`` as ``root``'s metadata: a temporary name, then the rename
    over ``.fp_dcp.meta`` (the commit).  If it fails before the rename, the
    temporary and ``data_files`` are removed.  ``sync``: fsync the file and the
    directory, before the rename too."""
    tmp = f"{fmt.METADATA_NAME}.{save_id}.tmp"
    try:
        root.replace_bytes(fmt.METADATA_NAME, blob, sync=sync, tmp_name=tmp, sync_rename=False)
    except BaseException as e:
        _abandon_commit(root, data_files)
        if isinstance(e, OSError) and str(e.filename).endswith(tmp) and "cannot write:" in str(e.strerror):
            raise type(e)(e.errno, str(e.strerror).replace("cannot write:", "cannot write the checkpoint metadata:"),
                          e.filename) from None
        raise
    if sync:
        root.sync()  # committed: a failure here must not remove the new checkpoint's files


def _abandon_commit(root: files.Root, data_files: Iterable[str]) -> None:
    for name in data_files:
        try:
            if "/" in name:
                _remove_in(os.path.dirname(name), {os.path.basename(name)}.__contains__)
            else:
                root.unlink(name)
        except OSError:
            pass


def _remove_in(directory: "str | files.Root", doomed) -> None:
    """Unlink the entries of ``directory`` (not a link itself when named by
    path) whose names ``doomed`` accepts; never a directory."""
    if isinstance(directory, str):
        with files.Root(directory, follow=False) as root:
            _remove_in(root, doomed)
        return
    for name, kind in directory.entries():
        if kind != "dir" and doomed(name):
            try:
                directory.unlink(name)
            except OSError:
                pass


def remove_superseded(root: files.Root, data_directories: list[tuple[str, bool]], data_files: list[str]) -> None:
    """After the commit: remove earlier saves' data files and leftover temporary
    metadata from ``root`` and this checkpoint's data-directory sub-directories
    (a sub-directory planted as a link is left alone)."""
    _remove_in(root, _stale(set(data_files)))
    for data_dir, by_path in data_directories:
        if by_path:
            keep = {os.path.basename(n) for n in data_files if os.path.dirname(n) == data_dir}
            try:
                _remove_in(data_dir, _stale(keep))
            except OSError:
                pass  # missing, or a link planted in its place: not followed


def _stale(keep: set[str]):
    def doomed(n: str) -> bool:
        stale_data = n.endswith(fmt.DATA_SUFFIX) and n not in keep
        stale_tmp = n.startswith(fmt.METADATA_NAME + ".") and n.endswith(".tmp")
        return stale_data or stale_tmp
    return doomed


def abandon_rank_files(data_directories: list[tuple[str, bool]], save_id: str, rank: int) -> None:
    """After rank ``rank`` failed to write its part of save ``save_id``:
    remove the data files it created (a full disk gets its space back); the
    previous checkpoint was never touched.  A data directory's checkpoint
    sub-directory planted as a link is not followed."""
    prefix = f"{save_id}.r{rank}."
    for directory, by_path in data_directories:
        try:
            with files.Root(directory, follow=not by_path) as root:
                _remove_in(root, lambda n: n.startswith(prefix) and n.endswith(fmt.DATA_SUFFIX))
        except OSError:
            continue


def remove_checkpoint_files(r: files.Root, name: str, path: str, layout: fmt.StorageLayout | None) -> None:
    """Remove an uncommitted checkpoint's files (``name`` under ``r``, at
    ``path``; ``layout``: its metadata's, None where unknown): those in its
    own sub-directories of data directories, then fp_dcp's own names in it,
    then the directory when empty."""
    external: list[str] = []
    named: set[str] = set()
    if layout is not None:
        try:
            # only files proven to lie in this checkpoint's own sub-directory
            # of a data directory (the writer's naming rule, checked here)
            paths = fmt.data_file_paths(path, layout)  # every name confined, or it raises
            external = [p for (f, _), p in zip(layout.files, paths) if "/" in f]
            named = {f for f, _ in layout.files if "/" not in f}
        except fmt.CheckpointFormatError:
            pass
    _remove_external(external)
    r.remove_owned(name, lambda rel, kind: kind in ("file", "link") and _own_name(rel, named))


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
            files.lstat_data_file(path)
            with files.Root(os.path.dirname(path), follow=False) as d:
                d.unlink(os.path.basename(path))
        except (OSError, fmt.CheckpointFormatError):
            pass
    for sub in {os.path.dirname(p) for p in external}:
        try:
            with files.Root(os.path.dirname(sub)) as parent:
                parent.rmdir(os.path.basename(sub))  # only when empty; a link is not a directory
        except OSError:
            pass
