"""The one file layer: every path fp_dcp opens, creates, renames, lists or
deletes goes through here, confined beneath a directory it holds open
(:class:`Root`: no link followed in any component, ``..`` and absolute paths
refused, reads ``fstat``-ed first).  Violations are :class:`UnsafePathError`
(an ``OSError`` naming the path).  All ``os`` calls go through this module's
``os`` (the crash tests replace it)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from typing import Any, Callable, Iterator

from fp_dcp import format as fmt

__all__ = [
    "Root", "UnsafePathError", "NotRegularFileError", "FileTooLargeError",
    "read_metadata_bytes", "read_checkpoint_metadata", "lstat_data_file", "read_small_file", "open_regular",
    "kind_of",
]

# The largest metadata file read (its header's own bound is larger): a
# state dict's metadata is some hundred bytes per tensor.
MAX_METADATA_BYTES = 1 << 31

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


class UnsafePathError(OSError):
    """A path beneath a root that fp_dcp refuses: a link in some component,
    ``..``, an absolute path, or an entry of the wrong type."""


class NotRegularFileError(UnsafePathError):
    """A FIFO, device, socket or directory where a regular file is expected."""


class FileTooLargeError(UnsafePathError):
    """A file larger than its caller's bound (checked before reading)."""


def kind_of(mode: int) -> str:
    """``file``, ``dir``, ``link`` or ``other`` for an ``lstat`` mode."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"


# ------------------------------------------------------------------ openat2

_SYS_OPENAT2 = 437  # the same number on every architecture Linux added it to
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_state: list[Any] = []  # [] unknown, [None] unavailable, [syscall] available


def _openat2() -> Any:
    if not _openat2_state:
        fn = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.syscall
            fn.restype = ctypes.c_long
            how = _OpenHow(_DIR_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
            fd = fn(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(-100), b".", ctypes.byref(how),
                    ctypes.c_size_t(ctypes.sizeof(how)))
            if fd < 0:
                fn = None  # ENOSYS, or a filter returning EPERM: walk instead
            else:
                os.close(fd)
        except (OSError, AttributeError):
            fn = None
        _openat2_state.append(fn)
    return _openat2_state[0]


def _open_beneath(dirfd: int, rel: str, flags: int, mode: int = 0) -> int:
    """``openat2(dirfd, rel, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``, or a
    component walk with ``O_NOFOLLOW | O_DIRECTORY``."""
    fn = _openat2()
    if fn is not None:
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, resolve)
        fd = fn(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dirfd), os.fsencode(rel), ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EPERM, errno.EAGAIN):
            raise OSError(e, os.strerror(e))
    parts = rel.split("/")
    cur = dirfd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=cur)
            if cur != dirfd:
                os.close(cur)
            cur = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=cur)
    finally:
        if cur != dirfd:
            os.close(cur)


def _check_rel(rel: str) -> str:
    rel = os.fspath(rel)
    if rel in ("", "."):
        return "."
    parts = rel.split("/")
    if rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(errno.EINVAL, "not a plain relative path beneath the directory", rel)
    return rel


# ------------------------------------------------------------------ Root


class Root:
    """A directory held open; every path beneath it resolved without
    following a link.  ``create``: make the directory (and its parents) when
    missing.  ``follow=False``: the directory may not itself be a link."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False, follow: bool = True,
                 _fd: int | None = None) -> None:
        self.path = os.fspath(path)
        self.fd = -1
        if _fd is not None:
            self.fd = _fd
            return
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        if create:
            try:
                os.makedirs(self.path, exist_ok=True)
            except FileExistsError:
                pass  # a link or a file in its place: refused by the open below
            except OSError as e:
                raise type(e)(e.errno, f"cannot create the directory: {e.strerror}", self.path) from None
        try:
            self.fd = os.open(self.path, flags)
        except OSError as e:
            if not follow and e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.path):
                raise UnsafePathError(e.errno, "the directory is a symbolic link; fp_dcp does not follow it",
                                      self.path) from None
            raise type(e)(e.errno, f"cannot open the directory: {e.strerror}", self.path) from None

    # context and lifetime
    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Root":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def join(self, rel: str) -> str:
        """The path of ``rel`` for messages."""
        return self.path if rel in ("", ".") else os.path.join(self.path, rel)

    def _error(self, e: OSError, rel: str, what: str) -> OSError:
        path = self.join(rel)
        if e.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR) and not isinstance(e, UnsafePathError):
            return UnsafePathError(
                e.errno, f"{what}: a component is a symbolic link or not a directory (fp_dcp follows "
                f"no link beneath {self.path})", path)
        if isinstance(e, UnsafePathError):
            return e
        return type(e)(e.errno, f"{what}: {e.strerror}", path)

    def _parent(self, rel: str) -> tuple[int, str]:
        """(descriptor of ``rel``'s directory, its last component); the
        caller closes the descriptor unless it is ``self.fd``."""
        rel = _check_rel(rel)
        head, _, leaf = rel.rpartition("/")
        if not head:
            return self.fd, leaf
        try:
            return _open_beneath(self.fd, head, _DIR_FLAGS), leaf
        except OSError as e:
            raise self._error(e, head, "cannot open the directory") from None

    def _release(self, fd: int) -> None:
        if fd != self.fd:
            os.close(fd)

    # opening
    def open_fd(self, rel: str, flags: int, mode: int = 0o644) -> int:
        """``open`` of ``rel`` beneath the root, following no link."""
        rel = _check_rel(rel)
        if rel == ".":
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=self.fd)
        try:
            return _open_beneath(self.fd, rel, flags | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        except OSError as e:
            raise self._error(e, rel, "cannot open") from None

    def open_read(self, rel: str, max_bytes: int | None = None) -> tuple[int, os.stat_result]:
        """A regular file opened for reading (non-blocking, no link) and its
        ``fstat``; anything else is refused before a byte is read."""
        try:
            fd = self.open_fd(rel, _READ_FLAGS)
        except OSError as e:
            if e.errno != errno.ENXIO:  # a socket (or a device with nothing behind it)
                raise
            raise NotRegularFileError(errno.ENXIO, "not a regular file (a socket or device); fp_dcp reads only "
                                      "regular files", self.join(rel)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFileError(
                    errno.EINVAL, f"not a regular file (a {_kind_name(st.st_mode)}); fp_dcp reads only "
                    f"regular files", self.join(rel))
            if max_bytes is not None and st.st_size > max_bytes:
                raise FileTooLargeError(
                    errno.EFBIG, f"file of {st.st_size} bytes is larger than the {max_bytes} this read "
                    f"accepts", self.join(rel))
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def read_bytes(self, rel: str, max_bytes: int) -> bytes:
        """The whole of regular file ``rel``, at most ``max_bytes`` long."""
        fd, st = self.open_read(rel, max_bytes)
        try:
            return _read_fd(fd, st.st_size, max_bytes, self.join(rel))
        finally:
            os.close(fd)

    def create_exclusive(self, rel: str, mode: int = 0o644) -> int:
        """A new file ``rel``, opened for writing; an existing entry (a link
        included) is a ``FileExistsError``."""
        return self.open_fd(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def sub(self, rel: str, *, create: bool = False) -> "Root":
        """The directory ``rel`` beneath, as a :class:`Root` (made when
        ``create``)."""
        if create:
            self.mkdir(rel, parents=True)
        return Root(self.join(rel), _fd=self.open_fd(rel, _DIR_FLAGS))

    # metadata of entries
    def lstat(self, rel: str) -> os.stat_result:
        pfd, leaf = self._parent(rel)
        try:
            return os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            raise self._error(e, rel, "cannot stat") from None
        finally:
            self._release(pfd)

    def exists(self, rel: str) -> bool:
        """Whether an entry of any type (a link included) is at ``rel``."""
        try:
            self.lstat(rel)
            return True
        except FileNotFoundError:
            return False

    def entries(self, rel: str = ".") -> list[tuple[str, str]]:
        """(name, kind) of each entry of directory ``rel``, kind by ``lstat``."""
        rel = _check_rel(rel)
        fd = self.fd if rel == "." else self.open_fd(rel, _DIR_FLAGS)
        try:
            out = []
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        out.append((e.name, kind_of(e.stat(follow_symlinks=False).st_mode)))
                    except FileNotFoundError:
                        continue
            return out
        finally:
            self._release(fd)

    # creating and changing
    def mkdir(self, rel: str, *, parents: bool = False, mode: int = 0o755) -> bool:
        """Make directory ``rel`` (and, with ``parents``, those above it)
        unless a real directory is there; a link or a file there is refused.
        Returns whether it was made."""
        rel = _check_rel(rel)
        if rel == ".":
            return False
        parts = rel.split("/")
        made = False
        for i in range(1 if parents else len(parts), len(parts) + 1):
            made = self._mkdir_one("/".join(parts[:i]), mode)
        return made

    def _mkdir_one(self, rel: str, mode: int) -> bool:
        pfd, leaf = self._parent(rel)
        try:
            os.mkdir(leaf, mode, dir_fd=pfd)
            return True
        except FileExistsError:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafePathError(
                    errno.ENOTDIR, f"a {_kind_name(st.st_mode)} is where fp_dcp makes a directory; "
                    f"remove it", self.join(rel)) from None
            return False
        except OSError as e:
            raise self._error(e, rel, "cannot make the directory") from None
        finally:
            self._release(pfd)

    def unlink(self, rel: str, *, missing_ok: bool = True) -> None:
        pfd, leaf = self._parent(rel)
        try:
            os.unlink(leaf, dir_fd=pfd)
        except FileNotFoundError:
            if not missing_ok:
                raise
        finally:
            self._release(pfd)

    def rmdir(self, rel: str) -> None:
        pfd, leaf = self._parent(rel)
        try:
            os.rmdir(leaf, dir_fd=pfd)
        finally:
            self._release(pfd)

    def rename(self, src: str, dst: str) -> None:
        """``renameat`` of ``src`` over ``dst``, both beneath the root."""
        sfd, sleaf = self._parent(src)
        try:
            dfd, dleaf = self._parent(dst)
            try:
                os.replace(sleaf, dleaf, src_dir_fd=sfd, dst_dir_fd=dfd)
            finally:
                self._release(dfd)
        finally:
            self._release(sfd)

    def move_to(self, rel: str, dst: "Root", dst_rel: str) -> None:
        """``renameat`` of ``rel`` beneath this root to ``dst_rel`` beneath
        ``dst`` (a root on the same file system); a link is moved, never
        followed."""
        sfd, sleaf = self._parent(rel)
        try:
            dfd, dleaf = dst._parent(dst_rel)
            try:
                os.replace(sleaf, dleaf, src_dir_fd=sfd, dst_dir_fd=dfd)
            except OSError as e:
                raise self._error(e, rel, f"cannot move to {dst.join(dst_rel)}") from None
            finally:
                dst._release(dfd)
        finally:
            self._release(sfd)

    def sync(self, rel: str = ".") -> None:
        """``fsync`` directory ``rel``: its new and renamed entries reach the disk."""
        rel = _check_rel(rel)
        if rel == ".":
            os.fsync(self.fd)
            return
        fd = self.open_fd(rel, _DIR_FLAGS)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def atomic_file(self, rel: str, *, sync: bool = True, tmp_name: str | None = None, mode: int = 0o644,
                    sync_rename: bool = True) -> Iterator[tuple[int, str]]:
        """Write a new ``rel`` atomically: yields ``(fd, temporary's path)`` of a
        temporary created ``O_EXCL | O_NOFOLLOW``; at the end it is synced
        (``sync``), renamed over ``rel``, the directory synced (``sync_rename``).  On
        failure before the rename the temporary is removed, ``rel`` untouched."""
        pfd, leaf = self._parent(rel)
        try:
            tmp = tmp_name or f".{leaf}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            tmp_rel = os.path.join(os.path.dirname(rel), tmp)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                             dir_fd=pfd)
            except OSError as e:
                raise self._error(e, tmp_rel, "cannot create") from None
            try:
                try:
                    yield fd, self.join(tmp_rel)
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if sync:
                    os.fsync(pfd)  # the temporary's entry before the rename can reach the disk
                os.replace(tmp, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
            except BaseException as e:
                try:
                    os.unlink(tmp, dir_fd=pfd)
                except OSError:
                    pass
                if isinstance(e, OSError) and e.filename is None:  # os.write/fsync name no file
                    raise type(e)(e.errno, f"cannot write: {e.strerror}", self.join(tmp_rel)) from None
                raise
            if sync and sync_rename:
                os.fsync(pfd)
        finally:
            self._release(pfd)

    def replace_bytes(self, rel: str, data: bytes | memoryview, *, sync: bool = True,
                      tmp_name: str | None = None, mode: int = 0o644, sync_rename: bool = True) -> None:
        """Atomically make ``rel`` hold ``data`` (:meth:`atomic_file`)."""
        with self.atomic_file(rel, sync=sync, tmp_name=tmp_name, mode=mode, sync_rename=sync_rename) as (fd, _):
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]

    def link_or_copy(self, rel: str, dst: "Root", dst_rel: str, *, sync: bool = True) -> None:
        """Make ``dst_rel`` beneath ``dst`` hold regular file ``rel``: a hard
        link where both lie on one file system, else an atomic copy."""
        fd, st = self.open_read(rel)
        try:
            spfd, sleaf = self._parent(rel)
            dpfd, dleaf = dst._parent(dst_rel)
            try:
                os.link(sleaf, dleaf, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
                return
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                    raise dst._error(e, dst_rel, "cannot link") from None
            finally:
                self._release(spfd)
                dst._release(dpfd)
            with dst.atomic_file(dst_rel, sync=sync) as (out, _):
                done = 0
                while done < st.st_size:
                    n = os.sendfile(out, fd, done, min(st.st_size - done, 1 << 30))
                    if n == 0:
                        raise OSError(errno.EIO, "the file shrank while it was copied", self.join(rel))
                    done += n
        finally:
            os.close(fd)

    # removing
    def remove_owned(self, rel: str, owns: Callable[[str, str], bool]) -> list[str]:
        """Remove ``rel``'s entries that ``owns(relpath, kind)`` accepts (links
        removed, never followed), then each owned directory left empty.  Returns
        the paths left."""
        left: list[str] = []
        pfd, leaf = self._parent(rel) if _check_rel(rel) != "." else (self.fd, ".")
        try:
            if leaf == ".":
                fd = os.dup(self.fd)
            else:
                try:
                    fd = os.open(leaf, _DIR_FLAGS, dir_fd=pfd)
                except OSError as e:
                    raise self._error(e, rel, "cannot open the directory to remove") from None
            try:
                _remove_owned_at(fd, "", owns, left)
            finally:
                os.close(fd)
            if not left and leaf != ".":
                os.rmdir(leaf, dir_fd=pfd)
        finally:
            self._release(pfd)
        return left

    def rmtree(self, rel: str) -> None:
        """Remove directory ``rel`` and everything in it (links removed, never
        followed), by directory descriptors."""
        left = self.remove_owned(rel, lambda _p, _k: True)
        if left:
            raise OSError(errno.ENOTEMPTY, "could not remove everything", self.join(rel))


def _remove_owned_at(fd: int, prefix: str, owns: Callable[[str, str], bool], left: list[str]) -> None:
    for name, kind in _scan(fd):
        rel = prefix + name
        if not owns(rel, kind):
            left.append(rel)
            continue
        if kind == "dir":
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                left.append(rel)  # replaced by a link meanwhile: not followed
                continue
            n = len(left)
            try:
                _remove_owned_at(sub, rel + "/", owns, left)
            finally:
                os.close(sub)
            if len(left) == n:
                try:
                    os.rmdir(name, dir_fd=fd)
                except OSError:
                    left.append(rel)
        else:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                left.append(rel)  # became a directory meanwhile


def _scan(fd: int) -> Iterator[tuple[str, str]]:
    with os.scandir(fd) as it:
        entries = list(it)
    for e in entries:
        try:
            yield e.name, kind_of(e.stat(follow_symlinks=False).st_mode)
        except FileNotFoundError:
            continue


def _kind_name(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def _read_fd(fd: int, size: int, max_bytes: int, path: str) -> bytes:
    """Read ``size`` bytes (the ``fstat`` size); a file that grew past
    ``max_bytes`` meanwhile is refused."""
    chunks = []
    want = min(size, max_bytes) + 1
    got = 0
    while got < want:
        b = os.read(fd, min(want - got, 64 << 20))
        if not b:
            break
        chunks.append(b)
        got += len(b)
    if got > max_bytes:
        raise FileTooLargeError(errno.EFBIG, f"file grew past the {max_bytes} bytes this read accepts", path)
    return b"".join(chunks)


# ------------------------------------------------------------------ checkpoints


def read_small_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of one regular file named by a full path (a record an
    environment variable names, say): its directory is opened as the user
    gave it, the file itself must be a regular file, not a link, of at most
    ``max_bytes`` (checked before reading)."""
    path = os.fspath(path)
    with Root(os.path.dirname(path) or ".") as root:
        return root.read_bytes(os.path.basename(path), max_bytes)


def open_regular(path: str | os.PathLike, max_bytes: int | None = None) -> int:
    """A descriptor of the regular file at ``path`` (its directory opened as
    given, the file itself no link), opened non-blocking and checked with
    ``fstat`` before it is returned; bounded by ``max_bytes``."""
    path = os.fspath(path)
    with Root(os.path.dirname(path) or ".") as root:
        return root.open_read(os.path.basename(path), max_bytes)[0]


def read_metadata_bytes(directory: "str | Root") -> bytes:
    """The bytes of ``directory``'s metadata file, opened without following a
    symbolic link, its magic and length checked before the whole is read.
    A missing file is a ``FileNotFoundError`` that says what the directory
    holds instead (a stock checkpoint, an interrupted save, nothing)."""
    if isinstance(directory, Root):
        return _read_metadata(directory)
    try:
        root = Root(directory)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(2, "no checkpoint directory here", directory) from None
    with root:
        return _read_metadata(root)


def _read_metadata(root: Root) -> bytes:
    directory = root.path
    path = os.path.join(directory, fmt.METADATA_NAME)
    try:
        fd, st = root.open_read(fmt.METADATA_NAME, MAX_METADATA_BYTES)
    except FileNotFoundError:
        _explain_missing(root, directory, path)
        raise
    except NotRegularFileError:
        raise fmt.CheckpointFormatError(
            f"{path}: the metadata is not a regular file (a FIFO, device or directory); fp_dcp "
            f"writes a regular file") from None
    except FileTooLargeError:
        raise fmt.CheckpointFormatError(f"{path}: metadata file of {root.lstat(fmt.METADATA_NAME).st_size} "
                                        f"bytes is too large") from None
    except UnsafePathError:
        raise fmt.CheckpointFormatError(
            f"{path}: the metadata file is a symbolic link; fp_dcp never writes one and does not "
            f"follow it out of the checkpoint directory") from None
    try:
        length = fmt.check_metadata_header(os.pread(fd, fmt.HEADER_SIZE, 0), st.st_size, path)
        return _read_fd(fd, st.st_size, fmt.HEADER_SIZE + length, path)
    finally:
        os.close(fd)


def _explain_missing(root: Root, directory: str, path: str) -> None:
    if root.exists(fmt.STOCK_METADATA_NAME):
        raise fmt.CheckpointFormatError(
            f"{directory}: this is a stock torch.distributed.checkpoint checkpoint (it has "
            f"'{fmt.STOCK_METADATA_NAME}', not '{fmt.METADATA_NAME}'). Load it with "
            f"FileSystemReader, or convert it once: fp-dcp convert --from-dcp {directory} OUT"
        ) from None
    partial = any(n.endswith(fmt.DATA_SUFFIX) for n, _ in root.entries())
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
