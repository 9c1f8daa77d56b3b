"""Writing over a retired checkpoint's blocks (``FastPersistWriter(path,
recycle=old)``): the coordinator retires ``old``, a committed fp_dcp
checkpoint the job would delete after this save anyway, and hands its data
files to the ranks, each of which renames one into the new checkpoint and
writes over it instead of into a new file.  A file system allocates no
blocks for such a write (and a thin-provisioned volume none underneath it),
which on many disks makes it much faster (docs/OPTIONS.md, "Recycling a
retired checkpoint").  Only a committed checkpoint's own data files are
taken, never through a link; what is not taken is removed once the save ends."""

from __future__ import annotations

import os
import stat
import warnings

from fp_dcp import format as fmt
from fp_dcp.files import Root, read_metadata_bytes
from fp_dcp.save.commit import SaveLock, remove_checkpoint_files

__all__ = ["Retired", "retire", "check_recycle_path", "open_recycled"]


def check_recycle_path(recycle: str, target: str) -> None:
    """Refuse (ValueError) a ``recycle`` directory that is the checkpoint
    directory ``target`` or lies inside it or around it."""
    old, new = os.path.realpath(recycle), os.path.realpath(target)
    if old == new or new.startswith(old.rstrip("/") + "/") or old.startswith(new.rstrip("/") + "/"):
        raise ValueError(
            f"FastPersistWriter(recycle={recycle!r}) names the checkpoint directory {target!r} itself, or a "
            "directory inside or around it; pass an older checkpoint, one this save replaces"
        )


def _writable_over(st: os.stat_result, device: int) -> bool:
    """Whether a retired data file (its ``lstat`` / ``fstat``) may be written
    over by a save on ``device``: a regular file there with no other link."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_dev == device


class Retired:
    """A checkpoint this save retired: no longer committed, locked by the
    coordinator until :meth:`remove`, with its data files in ``files``
    (name -> size) for the ranks to take."""

    def __init__(self, parent: Root, name: str, lock: SaveLock, layout: fmt.StorageLayout, files: dict[str, int],
                 path: str) -> None:
        self._parent = parent
        self._name = name
        self._lock = lock
        self._layout = layout
        self.files = files
        self.path = path

    def assign(self, rank_bytes: list[int]) -> list[str]:
        """A data file's path per rank ("" for none): the largest files to
        the ranks that write the most bytes into the checkpoint directory."""
        by_size = sorted(self.files, key=lambda n: (-self.files[n], n))
        ranks = sorted((r for r, n in enumerate(rank_bytes) if n > 0), key=lambda r: (-rank_bytes[r], r))
        out = [""] * len(rank_bytes)
        for r, name in zip(ranks, by_size):
            out[r] = os.path.join(self.path, name)
        return out

    def remove(self) -> None:
        """Remove what the ranks did not take (as rotation removes a
        checkpoint: fp_dcp's own files only), the directory when it is left
        empty, and release it."""
        try:
            remove_checkpoint_files(self._parent, self._name, self.path, self._layout)
        except OSError:
            pass  # left as it is: no longer a checkpoint, and rotation does not count it
        finally:
            self._lock.release()
            self._parent.close()


def retire(recycle: str, target: str) -> Retired | None:
    """Retire the committed checkpoint ``recycle`` for a save into ``target``:
    lock it, keep its data files that lie directly in it on ``target``'s file
    system, and remove its metadata (durably: it no longer names bytes about
    to be written over).  None, with a warning and nothing touched, where it
    is not a committed fp_dcp checkpoint, is a link, is being saved into, or
    has no such file."""
    check_recycle_path(recycle, target)

    def skip(why: str) -> None:
        warnings.warn(f"FastPersistWriter(recycle={recycle!r}): {why}; this save writes new files and leaves it "
                      "as it is", RuntimeWarning, stacklevel=4)

    head, name = os.path.split(os.path.normpath(recycle))
    try:
        parent = Root(head or ".")
    except OSError as e:
        skip(f"cannot open its parent directory ({e.strerror})")
        return None
    lock = SaveLock()
    try:
        try:
            ck = parent.sub(name)  # a link in its place is refused: never followed
        except OSError as e:
            skip(f"not a directory fp_dcp can use ({e.strerror})")
            raise _Skip from None
        with ck:
            try:
                _, layout, _ = fmt.decode_metadata(read_metadata_bytes(ck), ck.join(fmt.METADATA_NAME))
            except (OSError, fmt.CheckpointFormatError) as e:
                skip(f"not a committed fp_dcp checkpoint ({e})")
                raise _Skip from None
            # (only a committed checkpoint gets the lock file: nothing is made in a user's directory)
            if not lock.try_acquire(ck):
                skip("another fp_dcp save into it is in progress")
                raise _Skip
            if not ck.exists(fmt.METADATA_NAME):
                skip("it was removed meanwhile")
                raise _Skip
            device = os.stat(target).st_dev
            files = {}
            for f, _ in layout.files:
                if "/" in f or not fmt.valid_data_file_name(f):
                    continue  # in a data directory, or not a name fp_dcp writes: left to remove
                try:
                    st = ck.lstat(f)
                except OSError:
                    continue
                if _writable_over(st, device):
                    files[f] = st.st_size
            if not files:
                skip("none of its data files lies directly in it on the same file system as the new checkpoint")
                raise _Skip
            ck.unlink(fmt.METADATA_NAME)
            ck.sync()  # uncommitted on the disk before any of its bytes is written over
        return Retired(parent, name, lock, layout, files, os.path.join(head, name) if head else name)
    except _Skip:
        lock.release()
        parent.close()
        return None
    except BaseException:
        lock.release()
        parent.close()
        raise


class _Skip(Exception):
    pass


def open_recycled(src: str, directory: str, name: str, direct: bool) -> int:
    """Rename the retired data file ``src`` to ``name`` in ``directory`` and
    open it to be written over (O_DIRECT with ``direct``): its fd, or -1 where
    it cannot be (gone, no longer a regular file, another file system): the
    caller then makes a new file.  ``src`` comes from the coordinator's plan,
    so it is checked here too: a data file's name, in a directory that is no
    committed checkpoint (a lying peer cannot have a rank write over a file
    that is not a retired checkpoint's)."""
    head, leaf = os.path.split(src)
    if not fmt.valid_data_file_name(leaf) or not head:
        return -1
    flags = os.O_WRONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0)
    try:
        with Root(head, follow=False) as old, Root(directory) as new:
            device = os.fstat(new.fd).st_dev
            if old.exists(fmt.METADATA_NAME) or not _writable_over(old.lstat(leaf), device):
                return -1
            old.move_to(leaf, new, name)  # (moves a link swapped in meanwhile, never follows it)
            try:
                fd = new.open_fd(name, flags)
            except OSError:
                new.unlink(name)  # what the rename brought: not a file this save can write over
                return -1
            try:
                if not _writable_over(os.fstat(fd), device):  # (linked elsewhere meanwhile)
                    raise OSError
                os.set_blocking(fd, True)
            except OSError:
                os.close(fd)
                new.unlink(name)
                return -1
            return fd
    except OSError:
        return -1
