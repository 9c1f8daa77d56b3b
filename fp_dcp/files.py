"""Reading a checkpoint's own files, and nothing else.

Every fp_dcp operation that reads a checkpoint (load, ``inspect``,
``verify``, ``convert``, rotation) finds its files here, so the confinement
rule of ``docs/FORMAT.md`` ("Files") holds in one place:

* the metadata is opened with ``O_NOFOLLOW`` and must be a regular file of
  bounded size;
* the data files are the paths :func:`fp_dcp.format.data_file_paths` proves
  to lie in the checkpoint directory or in this checkpoint's sub-directory of
  a data directory; each must be a regular file, not a symbolic link (the
  engine opens them with ``O_NOFOLLOW`` too), and such a sub-directory must be
  a real directory.

Whatever breaks the rule is a :class:`~fp_dcp.format.CheckpointFormatError`
naming the entry, raised before anything outside is opened.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from fp_dcp import format as fmt

__all__ = ["read_metadata_bytes", "read_checkpoint_metadata", "lstat_data_file"]

# The largest metadata file read (its header's own bound is larger): a
# state dict's metadata is some hundred bytes per tensor.
_MAX_METADATA_BYTES = 1 << 31


def read_metadata_bytes(directory: str) -> bytes:
    """The bytes of ``directory``'s metadata file, opened without following a
    symbolic link.  A missing file is a ``FileNotFoundError`` that says what
    the directory holds instead (a stock checkpoint, an interrupted save,
    nothing)."""
    path = os.path.join(directory, fmt.METADATA_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        _explain_missing(directory, path)
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:  # the metadata is a symbolic link
            raise fmt.CheckpointFormatError(
                f"{path}: the metadata file is a symbolic link; fp_dcp never writes one and does not "
                f"follow it out of the checkpoint directory"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fmt.CheckpointFormatError(f"{path}: the metadata is not a regular file")
        if st.st_size > _MAX_METADATA_BYTES:
            raise fmt.CheckpointFormatError(f"{path}: metadata file of {st.st_size} bytes is too large")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(_MAX_METADATA_BYTES + 1)
    finally:
        os.close(fd)


def _explain_missing(directory: str, path: str) -> None:
    if os.path.lexists(os.path.join(directory, fmt.STOCK_METADATA_NAME)):
        raise fmt.CheckpointFormatError(
            f"{directory}: this is a stock torch.distributed.checkpoint checkpoint (it has "
            f"'{fmt.STOCK_METADATA_NAME}', not '{fmt.METADATA_NAME}'). Load it with "
            f"FileSystemReader, or convert it once: fp-dcp convert --from-dcp {directory} OUT"
        ) from None
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "no checkpoint directory here", directory) from None
    partial = any(n.endswith(fmt.DATA_SUFFIX) for n in os.listdir(directory))
    raise FileNotFoundError(
        2,
        "no committed fp_dcp checkpoint: the metadata file is missing"
        + (" (data files are there: a save was interrupted before its commit)" if partial else ""),
        path,
    ) from None


def lstat_data_file(path: str) -> os.stat_result:
    """``lstat`` of a data file that must be a regular file (not a link), in a
    directory that is not a link either when it is a data directory's
    sub-directory.  ``FileNotFoundError`` when it is missing."""
    if os.path.isabs(path):
        parent = os.path.dirname(path)
        pst = os.lstat(parent)
        if not stat.S_ISDIR(pst.st_mode):
            raise fmt.CheckpointFormatError(
                f"{parent}: a data directory's checkpoint sub-directory is a symbolic link or not a directory"
            )
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise fmt.CheckpointFormatError(
            f"{path}: the data file is a symbolic link or not a regular file; fp_dcp never writes one"
        )
    return st


def read_checkpoint_metadata(directory: str) -> tuple[Any, fmt.StorageLayout, dict[str, Any]]:
    """Read, validate and decode the metadata of the checkpoint in ``directory``,
    and check that its data files are all there, confined, and not truncated."""
    path = os.path.join(directory, fmt.METADATA_NAME)
    metadata, layout, extra = fmt.decode_metadata(read_metadata_bytes(directory), path)
    for fpath, (_, size) in zip(fmt.data_file_paths(directory, layout), layout.files):
        try:
            actual = lstat_data_file(fpath).st_size
        except FileNotFoundError:
            raise FileNotFoundError(
                2, "a data file of the checkpoint is missing; the checkpoint is damaged", fpath
            ) from None
        if actual < size:
            raise fmt.CheckpointFormatError(
                f"{fpath}: data file is truncated ({actual} bytes, the checkpoint recorded {size})"
            )
    return metadata, layout, extra
