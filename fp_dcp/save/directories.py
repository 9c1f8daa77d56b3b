"""Where a save's files go (the checkpoint directory, or with
``options.data_dirs`` a sub-directory per checkpoint in each data directory),
and making those directories ready."""

from __future__ import annotations

import errno
import os
from typing import Any

from fp_dcp import format as fmt
from fp_dcp.files import Root, UnsafePathError

__all__ = ["parse_data_dirs", "data_directories", "make_checkpoint_directory", "make_data_directory"]


def parse_data_dirs(value: Any) -> tuple[str, ...]:
    """``options.data_dirs`` as absolute paths: a sequence of paths, or one
    string of paths separated by ``os.pathsep`` (the environment's form)."""
    if value is None or value == "" or value == ():
        return ()
    if isinstance(value, (str, os.PathLike)):
        parts = [p for p in os.fspath(value).split(os.pathsep) if p.strip()]
    else:
        parts = [os.fspath(p) for p in value]
    dirs = tuple(os.path.abspath(p) for p in parts)
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(d)
        if real in seen:
            raise ValueError(
                f"FastPersistOptions.data_dirs names one directory twice ({seen[real]!r} and {d!r}): "
                f"give one directory per storage device"
            )
        seen[real] = d
    return dirs


def data_directories(directory: str, data_dirs: tuple[str, ...]) -> list[tuple[str, bool]]:
    """``(directory, named by absolute path)`` of each of a rank's devices:
    the checkpoint ``directory`` without ``data_dirs``; else, for each data
    directory, its sub-directory named after the checkpoint (or the
    checkpoint directory itself, when it is one of them)."""
    if not data_dirs:
        return [(directory, False)]
    out = []
    real = os.path.realpath(directory)
    for d in data_dirs:
        if os.path.realpath(d) == real:
            out.append((directory, False))
        else:
            out.append((os.path.join(d, fmt.data_subdir_name(directory)), True))
    return out


def make_checkpoint_directory(directory: str, overwrite: bool) -> None:
    """Create the checkpoint directory if needed; refuse a path that is not
    a directory, and (without ``overwrite``) one that holds a committed
    checkpoint."""
    try:
        root = Root(directory, create=True)
    except OSError as e:
        why = str(e.strerror)
        if e.errno == errno.ENOTDIR and not why.startswith("cannot create"):
            raise NotADirectoryError(20, "the checkpoint path exists and is not a directory", directory) from None
        why = why.removeprefix("cannot create the directory: ").removeprefix("cannot open the directory: ")
        raise type(e)(e.errno, f"cannot create the checkpoint directory: {why}", directory) from None
    with root:
        if not overwrite and root.exists(fmt.METADATA_NAME):
            raise FileExistsError(
                17,
                "a committed fp_dcp checkpoint is already there and overwrite=False; "
                "pass another path or FastPersistOptions(overwrite=True)",
                directory,
            )


def make_data_directory(d: str, by_path: bool, sync: bool) -> None:
    """Create this checkpoint's sub-directory ``d`` of a data directory
    (``by_path``; the checkpoint directory itself needs nothing) and, with
    ``sync``, sync its entry; refuse one that is a link or not a directory."""
    if not by_path:
        return
    try:
        with Root(os.path.dirname(d), create=True) as parent:
            # fp_dcp creates this sub-directory: a link planted in its place
            # would lead the writes and the clean-up elsewhere (refused)
            if parent.mkdir(os.path.basename(d)) and sync:
                parent.sync()
    except OSError as e:
        if isinstance(e, UnsafePathError):
            raise OSError(errno.ENOTDIR, "this checkpoint's sub-directory of a data directory is a "
                          "symbolic link or not a directory (fp_dcp creates a real one); remove it", d) from None
        raise type(e)(e.errno, f"cannot use the data directory: {e.strerror}", d) from None
