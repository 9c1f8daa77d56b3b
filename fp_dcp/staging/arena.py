"""Host memory for staging: :class:`Arena` (one pre-faulted, page-locked
buffer, private or a ``memfd`` shared with a checkpoint process, whose first
page is a header the checkpoint process reports through), :func:`attach` /
:func:`attach_spill` (a checkpoint process opening the trainer's buffers) and
:class:`Spill` (the file for tensors past the memory limit)."""

# A checkpoint process opens the trainer's memfd (or spill file) through
# /proc/<pid>/fd -- no /dev/shm size limit applies -- after checking that the
# descriptor still names the same buffer.  Nothing here knows the state dict
# or its layout: the stager decides what goes where.

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import secrets
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

from fp_dcp import _native, pinned
from fp_dcp.engine import IOSession

__all__ = ["PAGE", "Arena", "Spill", "attach", "attach_spill", "buffer_address", "write_status",
           "PENDING", "RUNNING", "OK", "FAILED"]

PAGE = _native.page_size()
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# Names of the memfd and of the spill file; attach checks them (descriptor
# numbers are reused once the saving process closes the buffer).
_ARENA_PREFIX = "fp_dcp-arena-"
_SPILL_PREFIX = ".fp_dcp-spill-"

# ------------------------------------------------------------- the header page

# The arena's first page: the outcome of the save that uses it, written by the
# writer of the checkpoint process (PROCESS mode) and read by this one.
_HEADER = struct.Struct("<8sQII")  # magic, save sequence number, state, message length
_MAGIC = b"FPDCPSTG"
PENDING, RUNNING, OK, FAILED = 0, 1, 2, 3


def write_status(buf: Any, seq: int, state: int, msg: str = "") -> None:
    """Post the state of save ``seq`` (and a message) on the header page of ``buf``."""
    data = msg.encode("utf-8", "replace")[: PAGE - _HEADER.size]
    mv = memoryview(buf)
    try:
        mv[_HEADER.size : _HEADER.size + len(data)] = data
        _HEADER.pack_into(mv, 0, _MAGIC, seq, state, len(data))
    finally:
        mv.release()


# ------------------------------------------------------------------ the arena


def buffer_address(buf: Any) -> int:
    """The address of a writable buffer's first byte (an ``mmap``)."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


class Arena:
    """The staging arena: ``AlignedBuffer`` (private) or a ``memfd`` mapping
    (shared with a checkpoint process); pre-faulted, page-locked, registered
    with CUDA on demand.  ``close()`` (or garbage collection) releases it."""

    def __init__(self, size: int, alignment: int, shared: bool) -> None:
        self.size = size
        self.shared = shared
        self.token = secrets.token_hex(8)
        self.pid = os.getpid()
        fd = -1
        if shared:
            fd = os.memfd_create(_ARENA_PREFIX + self.token, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                buf: Any = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
            except BaseException:
                os.close(fd)
                raise
            self.address = buffer_address(buf)
            self.locked = pinned.lock_pages(self.address, size, "staging arena")
        else:
            buf = _native.AlignedBuffer(size, alignment)
            self.address = buf.address
            self.locked = bool(buf.locked)
        self.fd = fd
        self.buf = buf
        self.cuda_registered = False
        self._res = [buf, fd, 0]  # what the finalizer releases: buffer, memfd, CUDA address
        self._finalizer = weakref.finalize(self, Arena._release, self._res)

    def register_cuda(self) -> None:
        """Register the arena with CUDA (once; a no-op without CUDA)."""
        if self.cuda_registered or not torch.cuda.is_available():
            return
        if pinned.cuda_register(self.address, self.size, "staging arena", portable=True):
            self.cuda_registered = True
            self._res[2] = self.address

    def read_status(self, seq: int) -> tuple[int, str]:
        """(state, message) that save ``seq`` posted on the header page
        (``PENDING`` while it has posted nothing)."""
        magic, s, state, n = _HEADER.unpack_from(self.buf, 0)
        if magic != _MAGIC or s != seq:
            return PENDING, ""
        msg = bytes(memoryview(self.buf)[_HEADER.size : _HEADER.size + n]).decode("utf-8", "replace")
        return state, msg

    def handle(self) -> tuple[int, int, str, int]:
        """What another process needs to :func:`attach` this arena."""
        return (self.pid, self.fd, self.token, self.size)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self.buf = None
        self._finalizer()

    @staticmethod
    def _release(res: list) -> None:
        buf, fd, cuda_address = res
        res[:] = [None, -1, 0]
        if cuda_address:
            pinned.cuda_unregister(cuda_address)
        closed = True
        if buf is not None:
            try:
                buf.close()
            except BufferError:
                closed = False  # staged views still use it: freed with the last one
        if fd >= 0:
            if closed:
                try:
                    os.ftruncate(fd, 0)  # the checkpoint process's mapping holds nothing now
                except OSError:
                    pass
            os.close(fd)


# --------------------------------------------------------- cross-process attach

# Mappings of other processes' arenas (the checkpoint process side), by
# token; the last _ATTACHED_KEEP are kept so that a save does not fault the
# arena in again: the writer's current arena and the one it replaced (a
# writer replaces its arena when the state dict outgrows it), the older ones
# are unmapped.
_ATTACHED: "collections.OrderedDict[str, mmap.mmap]" = collections.OrderedDict()
_ATTACHED_LOCK = threading.Lock()
_ATTACHED_KEEP = 2


def _open_other(pid: int, fd: int, token: str, prefix: str, flags: int) -> int:
    """Open another process's descriptor ``fd`` through /proc, checking that it
    is still the buffer named ``token`` (descriptor numbers are reused)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
        if prefix not in target or token not in target:
            raise FileNotFoundError(2, f"it is now {target!r}: the saving process closed the buffer")
        return os.open(path, flags | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot reach the staging buffer of process {pid}: {e.strerror}", path) from None


def attach(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    """Map another process's shared arena (its :meth:`Arena.handle`; cached:
    the same arena serves every save of that writer)."""
    with _ATTACHED_LOCK:
        key = f"{pid}:{token}"
        m = _ATTACHED.get(key)
        if m is not None:
            _ATTACHED.move_to_end(key)
            return m
        nfd = _open_other(pid, fd, token, _ARENA_PREFIX, os.O_RDWR)
        try:
            m = mmap.mmap(nfd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(nfd)
        _ATTACHED[key] = m
        while len(_ATTACHED) > _ATTACHED_KEEP:
            _ATTACHED.popitem(last=False)  # unmapped when its last view goes
        return m


def attach_spill(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    """Map another process's spill file (its :meth:`Spill.handle`) read-only."""
    nfd = _open_other(pid, fd, token, _SPILL_PREFIX, os.O_RDONLY)
    try:
        return mmap.mmap(nfd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(nfd)


# ------------------------------------------------------------- the spill file


class Spill:
    """The unlinked file that tensors past the memory limit stream into."""

    def __init__(self, directory: str, options: Any) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.session = IOSession(options, directory)
        self.token = secrets.token_hex(8)
        self.path = os.path.join(directory, f"{_SPILL_PREFIX}{os.getpid()}-{self.token}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.session.direct:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except BaseException:
            self.session.close()
            raise
        os.unlink(self.path)  # nothing is left behind, whatever happens
        self.dev = os.fstat(self.fd).st_dev
        self.size = 0

    def resize(self, size: int) -> None:
        if size != self.size:
            os.ftruncate(self.fd, size)
            self.size = size

    def write(self, offset: int, view: memoryview) -> dict:
        """Write ``view`` at ``offset`` (through the engine); releases ``view``."""
        try:
            return self.session.write_fds(
                [self.fd], [self.path], np.zeros(1, np.int64), np.asarray([offset], np.int64), [view], sync=False
            )
        finally:
            view.release()

    def mapping(self) -> mmap.mmap:
        # Private and writable: torch.frombuffer wants a writable buffer; pages
        # are never written, so nothing is copied.
        return mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def drop_cache(self) -> None:
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass

    def handle(self) -> tuple[int, int, str, int]:
        """What another process needs to :func:`attach_spill` this file."""
        return (os.getpid(), self.fd, self.token, self.size)

    def close(self) -> None:
        self.session.close()
        os.close(self.fd)
