"""Asynchronous and lazy staging: ``FastPersistWriter`` as DCP's ``AsyncStager``.

``dcp.async_save(state_dict, storage_writer=FastPersistWriter(path))`` finds
that the writer implements the ``AsyncStager`` protocol and calls its
:meth:`~AsyncStagingMixin.stage` on the training thread, then saves what
``stage`` returned in the background (a thread, or a separate process with
``AsyncCheckpointerType.PROCESS``).

The arena
    Every staged tensor is copied into one host buffer, the *arena*:
    allocated once, pre-faulted, page-locked (``mlock``) and registered with
    CUDA (``cudaHostRegister``) when the state dict holds CUDA tensors.  A
    tensor of at least ``pack_threshold_bytes`` starts on a direct-I/O
    boundary, smaller ones are packed at ``pack_alignment_bytes`` — the rule
    the writer uses in its files — so the engine writes the staged tensors
    straight from the arena (``writer.last_stats["zero_copy_bytes"]``).  The
    arena is the state dict's bytes plus that padding plus one page of
    header; it is reused by every later save and replaced by a larger one
    only when the state dict outgrows it.  The copy of a CPU tensor into the
    arena also computes the CRC-32C of each 1 MiB block in the same pass
    over memory (``staging_checksums``), and the writer stores those instead
    of reading the arena again to checksum it: less CPU taken from the
    training in all, for a copy about a fifth slower than a plain memcpy.  First-touch page faults cost
    about 40x a warm copy on the machines this was built on: paying them once
    is the point.

    The staged state dict has the structure of the original: tensors are
    views into the arena (``torch.frombuffer``), a ``DTensor`` is rebuilt
    around its staged local shard with the same mesh, placements, shape and
    stride (so DCP plans the same items), anything else is deep-copied when
    ``stage`` is called.

Eager and lazy (``FastPersistOptions.staging``)
    ``"eager"`` (default): ``stage`` returns once every byte is in the arena;
    ``dcp.async_save`` returns a ``Future`` as with any stager, and the
    training may change the state as soon as it returns.  The training waits
    for this copy anyway, so it is split over ``torch.get_num_threads()``
    threads (at most 4), the GIL released.

    ``"lazy"`` (DataStates-LLM): ``stage`` returns a
    ``concurrent.futures.Future`` at once and the copy runs in a background
    thread — CPU tensors through one thread's ``memcpy`` with the GIL
    released (the other cores stay with the training), CUDA tensors on a
    side stream that first waits for the work queued on the tensors' streams
    when ``stage`` was called (device-to-host DMA into the registered arena).
    DCP starts writing only when staging is complete, so within the memory
    limit the copies of all tensors are queued at once and awaited together.  ``dcp.async_save`` then
    returns ``AsyncSaveResponse``; the training loop must wait on
    ``staging_completion`` before it changes the state, i.e. before
    ``optimizer.step()``::

        resp = dcp.async_save(sd, storage_writer=writer)   # returns at once
        loss = model(batch).sum(); loss.backward()         # overlaps the copy
        resp.staging_completion.result()
        optimizer.step()

    Parameters and optimizer state do not change between two optimizer
    steps; buffers that the forward pass updates (BatchNorm running
    statistics) do, and lazy staging may catch them mid-forward.  Use eager
    staging for state dicts with such buffers when that matters.

A memory bound (``staging_memory_limit_bytes``)
    The arena never exceeds the limit.  When a state dict does not fit, the
    tensors that fit (first fit, in state-dict order) are staged in the
    arena as usual; the others are streamed, chunk by chunk, through a ring
    of two page-locked slots carved from the same budget into an unlinked
    *spill file* (``staging_spill_dir``, default the checkpoint directory)
    with ``O_DIRECT`` writes — the copy (CPU memcpy, or CUDA device-to-host
    chunks on the side stream) of slot k+1 overlaps the write of slot k, and
    the copy waits for a free slot (back-pressure).  Staging is complete
    — eager ``stage`` returns, the lazy future resolves — only when those
    bytes are on the spill file, so **past the limit the training is held
    until the bytes that did not fit are written** (at disk speed, not
    memory speed).  The save then writes the spilled tensors from a
    read-only mapping of the spill file: those bytes are written twice and
    read once, and while the save reads them they occupy clean page cache
    that the kernel can reclaim, never anonymous or locked memory.  Nothing
    fails for lack of memory; a save past the limit is just slower.

``AsyncCheckpointerType.PROCESS``
    The checkpoint process receives the staged state dict by pickling.  A
    staged state dict pickles as one handle to the arena (a ``memfd``, opened
    by the other process through ``/proc/<pid>/fd``; no ``/dev/shm`` size
    limit applies), the layout and the non-tensor values: one handle, not
    one shared-memory segment per tensor.  The checkpoint process maps an
    arena once and keeps the mapping for later saves.  With
    ``staging_shared_memory=None`` (default) the arena starts private and
    the first time a staged state dict is pickled the writer moves to a
    shared arena (that save pays one extra copy and holds both arenas until
    it ends; later saves stage into shared memory directly).  ``True`` uses shared memory from the first
    save; ``False`` never does (the state dict then pickles the way torch
    pickles tensors: a copy into one shared segment per tensor per save).
    The writer itself is pickled too: it travels without its engine, lock
    and staging state, and reports its outcome back through the arena's
    header page.

One save in flight, and failures
    A writer runs at most one save at a time.  A second ``async_save`` while
    one is in flight **waits** for it: eager ``stage`` blocks; lazy ``stage``
    still returns at once and its copy starts when the previous save has
    finished on this rank (the wait then shows in ``staging_completion``).
    A failure of a background save (staging, writing, committing) is set on
    the future ``dcp.async_save`` returned, by DCP, and is raised again,
    once, by the next save on this writer: eager ``async_save`` raises it,
    lazy ``staging_completion`` (and the upload) fail with it.  The call
    after that proceeds.  A rank sees the failures of its own part of the
    save; a save that failed on another rank only after this rank's data
    was written is reported on the future only.

Lifetime
    ``writer.close()`` waits for the save in flight, then unregisters,
    unlocks and frees the arena, the ring and the spill file (and truncates
    a shared arena so that the checkpoint process's mapping holds no memory
    either).  A staged state dict the caller still holds keeps its own views
    valid: memory that views still use is freed with the last view.

Process groups
    Staging makes no collective call.  With ``AsyncCheckpointerType.PROCESS``,
    DCP saves through the checkpoint process's own gloo group.  With
    ``AsyncCheckpointerType.THREAD``, DCP runs its save's collectives on
    ``async_save``'s ``process_group`` argument, the default group when it is
    ``None`` — concurrent with the training's own collectives on that group
    when the training uses it (gloo on CPU).  Pass a group created for
    checkpointing: ``dcp.async_save(..., process_group=dist.new_group(backend="gloo"))``
    (created once, on every rank).
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import ctypes
import dataclasses
import functools
import gc
import mmap
import os
import secrets
import struct
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import numpy as np
import torch

from fp_dcp import _native, _dcp_hooks
from fp_dcp import format as fmt
from fp_dcp.save.layout import align_up

__all__ = ["AsyncStagingMixin"]

try:  # torch built without distributed
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

STAGING_MODES = ("eager", "lazy")

_PAGE = _native.page_size()
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_ARENA_PREFIX = "fp_dcp-arena-"
_SPILL_PREFIX = ".fp_dcp-spill-"

# Eager staging splits its memcpy over up to this many threads, in pieces of
# at most _COPY_PIECE bytes.
_MAX_COPY_THREADS = 4
_COPY_PIECE = 64 << 20

# Where a staged tensor lives.
_ARENA, _SPILL, _EMPTY = 0, 1, 2

# The arena's first page: the outcome of the save that uses it, written by the
# writer of the checkpoint process (PROCESS mode) and read by this one.
_HEADER = struct.Struct("<8sQII")  # magic, save sequence number, state, message length
_MAGIC = b"FPDCPSTG"
_PENDING, _RUNNING, _OK, _FAILED = 0, 1, 2, 3

# Writer methods whose calls tell which save is running, and how it ends.
_TRACKED = ("set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish")


# ----------------------------------------------------------------- the mixin


class AsyncStagingMixin:
    """The ``AsyncStager`` side of :class:`~fp_dcp.FastPersistWriter` (see the
    module documentation for the semantics).

    The host class provides ``options`` (a ``FastPersistOptions``), ``path``
    and ``reset()``, and calls :meth:`_close_staging` from its ``close()``.
    The mixin wraps the host's ``set_up_storage_writer``,
    ``prepare_local_plan``, ``prepare_global_plan``, ``write_data`` and
    ``finish`` (in ``__init_subclass__``) to learn which thread runs a staged
    save and how it ends; the wrapped methods behave exactly as before.
    """

    # AsyncStager protocol: staging is complete when stage() returns (eager) or
    # its future resolves (lazy); async_save never needs synchronize_staging().
    _synchronize_after_execute: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _TRACKED:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_fp_tracked", False):
                setattr(cls, name, _tracked(name, fn))

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | concurrent.futures.Future:
        """Copy ``state_dict`` into the arena: the staged copy (eager) or a
        future of it (lazy).  Called by ``dcp.async_save``."""
        return self._stager().stage(self, state_dict)

    def synchronize_staging(self) -> None:
        """Wait until the last lazy staging is complete (a no-op for eager
        staging).  ``AsyncSaveResponse.staging_completion`` is the better way."""
        st = self.__dict__.get("_fp_staging")
        if st is not None:
            st.synchronize()

    @property
    def staging_stats(self) -> dict[str, Any]:
        """What the last staging did: seconds, bytes, arena size, spilled
        bytes, whether the arena was (re)allocated, shared, page-locked."""
        st = self.__dict__.get("_fp_staging")
        return dict(st.last_stats) if st is not None else {}

    def _stager(self) -> "_Stager":
        st = self.__dict__.get("_fp_staging")
        if st is None:
            st = self.__dict__["_fp_staging"] = _Stager()
        return st

    def _close_staging(self) -> None:
        """Wait for the save in flight, then free the arena, ring and spill file."""
        st = self.__dict__.pop("_fp_staging", None)
        if st is not None:
            st.close()

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer with each request.  Its engine, lock
        # and staging state stay here; the copy reports through the arena.
        state = self.__dict__.copy()
        st = state.pop("_fp_staging", None)
        state.pop("_fp_report", None)
        for name, value in state.items():
            if name == "_lock_fd" or _is_resource(value):
                state[name] = None
            elif isinstance(value, dict) and any(_is_resource(v) for v in value.values()):
                state[name] = {}
        if st is not None:
            state["_fp_report"] = st.report_handle()
        return state


def _is_resource(value: Any) -> bool:
    """Engines, sessions and buffers: they stay with the process that made them."""
    from fp_dcp.engine import IOSession, PinnedBuffer

    return isinstance(value, (IOSession, PinnedBuffer, _native.AlignedBuffer, _native.Engine))


def _tracked(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        st = self.__dict__.get("_fp_staging")
        if st is not None:
            track = st.track(name, args, kwargs)
        else:
            report = self.__dict__.get("_fp_report")
            track = _Reporter(report, name, args, kwargs) if report is not None else None
        if track is None:
            return fn(self, *args, **kwargs)
        try:
            out = fn(self, *args, **kwargs)
        except BaseException as e:
            track.failed(e)
            raise
        if name == "write_data" and hasattr(out, "add_done_callback"):
            def done(f: Any) -> None:
                try:
                    f.value()
                except BaseException as e:  # noqa: BLE001 - recorded, DCP raises it
                    track.failed(e)
                else:
                    track.written()

            out.add_done_callback(done)
        elif name == "write_data":
            track.written()
        elif name == "finish":
            track.finished()
        return out

    wrapper._fp_tracked = True  # type: ignore[attr-defined]
    return wrapper


# ------------------------------------------------------------ one save's record


class _PreviousSaveFailed(RuntimeError):
    pass


class _Save:
    """One staged save on this rank: from ``stage`` until the writer is done
    with it (coordinator: ``finish`` returned; other ranks: ``write_data``
    completed), it failed, or the thread running it ended."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.reported = False
        self.thread: threading.Thread | None = None
        self.coordinator = True
        self.collectives = True
        self.staged = False  # staging finished (the save may start)
        self.process = False  # pickled for a checkpoint process
        self.reporting = False  # ... whose writer reports through the arena header
        self.arena: _Arena | None = None
        self.refs: list[weakref.ref] = []  # the staged dict / lazy future
        self.snapshot: weakref.ref | None = None
        self.via_async_save = False  # a DCP save will pick the staged dict up
        self.copy_threads = 1  # memcpy threads of its staging

    def finish(self, error: BaseException | None = None, *, reported: bool = False) -> None:
        if not self.done.is_set():
            self.error = error
            self.reported = reported or error is None
            self.done.set()

    def _orphaned(self) -> bool:
        """Staged, never picked up by a save, and nobody holds it any more
        (an ``async_save`` that failed after staging, a dropped ``stage()``)."""
        return self.thread is None and self.staged and all(r() is None for r in self.refs)

    def wait(self) -> None:
        me = threading.current_thread()
        polls = 0
        while not self.done.is_set():
            t = self.thread
            if t is None:
                if self._orphaned():
                    self.finish(None)
                elif not self.done.wait(0.05):
                    polls += 1
                    if polls % 20 == 0:
                        gc.collect()  # a staged dict held only by a reference cycle (a traceback)
                continue
            if t is not me:
                t.join(0.1)
                if t.is_alive():
                    continue
            # The thread that ran the save has ended (or is this one: a save
            # run synchronously after stage()) without the writer finishing.
            self._ended()

    def _ended(self) -> None:
        if self.process and not self.reporting:
            self.finish(None)  # no way to learn how it went here: the future tells
            return
        if self.process and self.arena is not None:
            state, msg = self.arena.read_status(self.seq)
            if state == _OK:
                self.finish(None)
                return
            if state == _FAILED:
                self.finish(RuntimeError(f"the checkpoint process failed: {msg}"))
                return
        self.finish(
            RuntimeError(
                "the save did not complete on this rank (see the future that dcp.async_save returned)"
            )
        )


class _Track:
    """Hook calls of the writer, attributed to one ``_Save``."""

    def __init__(self, rec: _Save, name: str, args: tuple, kwargs: dict) -> None:
        self.rec = rec
        if name == "set_up_storage_writer":
            rec.coordinator = bool(args[0] if args else kwargs.get("is_coordinator", True))
            rec.collectives = bool(kwargs.get("use_collectives", True))

    def failed(self, e: BaseException) -> None:
        self.rec.finish(e)

    def written(self) -> None:
        if not self.rec.coordinator and self.rec.collectives:
            self.rec.finish(None)  # this rank's writer is not used again

    def finished(self) -> None:
        self.rec.finish(None)


class _Reporter:
    """The same hooks in the checkpoint process: the outcome goes to the header
    page of the arena the staged state dict came in."""

    def __init__(self, handle: tuple, name: str, args: tuple, kwargs: dict) -> None:
        self.handle = handle
        self.coordinator = True
        self.collectives = True
        if name == "set_up_storage_writer":
            coordinator = bool(args[0] if args else kwargs.get("is_coordinator", True))
            collectives = bool(kwargs.get("use_collectives", True))
            handle[-1]["coordinator"] = coordinator
            handle[-1]["collectives"] = collectives
            self._post(_RUNNING)
        self.coordinator = handle[-1].get("coordinator", True)
        self.collectives = handle[-1].get("collectives", True)

    def _post(self, state: int, msg: str = "") -> None:
        pid, fd, token, size, seq, _ = self.handle
        try:
            buf = _attach(pid, fd, token, size)
            _write_status(buf, seq, state, msg)
        except OSError:
            pass  # the trainer went away; nobody to tell

    def failed(self, e: BaseException) -> None:
        self._post(_FAILED, f"{type(e).__name__}: {e}")

    def written(self) -> None:
        if not self.coordinator and self.collectives:
            self._post(_OK)

    def finished(self) -> None:
        self._post(_OK)


def _write_status(buf: Any, seq: int, state: int, msg: str = "") -> None:
    data = msg.encode("utf-8", "replace")[: _PAGE - _HEADER.size]
    mv = memoryview(buf)
    try:
        mv[_HEADER.size : _HEADER.size + len(data)] = data
        _HEADER.pack_into(mv, 0, _MAGIC, seq, state, len(data))
    finally:
        mv.release()


# ------------------------------------------------------------------ the arena

_libc = ctypes.CDLL(None, use_errno=True)
_mlock_warned = False


def _buffer_address(buf: Any) -> int:
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _mlock(address: int, size: int) -> bool:
    global _mlock_warned
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) == 0:
        return True
    if not _mlock_warned:
        _mlock_warned = True
        err = ctypes.get_errno()
        warnings.warn(
            f"fp_dcp: the staging arena is not page-locked: mlock of {size} bytes "
            f"failed: {os.strerror(err)} (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


class _Arena:
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
            self.address = _buffer_address(buf)
            self.locked = _mlock(self.address, size)
        else:
            buf = _native.AlignedBuffer(size, alignment)
            self.address = buf.address
            self.locked = bool(buf.locked)
        self.fd = fd
        self.buf = buf
        self.cuda_registered = False
        self._res = [buf, fd, 0]  # what the finalizer releases: buffer, memfd, CUDA address
        self._finalizer = weakref.finalize(self, _Arena._release, self._res)

    def register_cuda(self) -> None:
        if self.cuda_registered or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.size, 1)  # cudaHostRegisterPortable
        if int(rc) == 0:
            self.cuda_registered = True
            self._res[2] = self.address
        else:
            warnings.warn(
                f"fp_dcp: cudaHostRegister of the {self.size}-byte staging arena failed ({rc}); "
                f"device-to-host copies will not be DMA transfers",
                RuntimeWarning,
                stacklevel=3,
            )

    def read_status(self, seq: int) -> tuple[int, str]:
        magic, s, state, n = _HEADER.unpack_from(self.buf, 0)
        if magic != _MAGIC or s != seq:
            return _PENDING, ""
        msg = bytes(memoryview(self.buf)[_HEADER.size : _HEADER.size + n]).decode("utf-8", "replace")
        return state, msg

    def handle(self) -> tuple[int, int, str, int]:
        return (self.pid, self.fd, self.token, self.size)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        forget_staged_checksums([self.address])
        self.buf = None
        self._finalizer()

    @staticmethod
    def _release(res: list) -> None:
        buf, fd, cuda_address = res
        res[:] = [None, -1, 0]
        if cuda_address:
            try:
                torch.cuda.cudart().cudaHostUnregister(cuda_address)
            except Exception:  # noqa: BLE001 - CUDA already torn down at exit
                pass
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


# Mappings of other processes' arenas (the checkpoint process side), by token;
# the last few are kept so that a save does not fault the arena in again.
_ATTACHED: "collections.OrderedDict[str, mmap.mmap]" = collections.OrderedDict()
_ATTACHED_LOCK = threading.Lock()
_ATTACHED_KEEP = 2


# ------------------------------------------- checksums of the staging copy

# The staging copy of a CPU tensor computes the CRC-32C of every
# CHECKSUM_BLOCK_BYTES block of the tensor in the same pass over memory
# (``_native.copy_gather(..., checksum_block=...)``), so that the writer need not
# read the arena a second time to checksum it.  By arena address: (the buffer
# — held, so that its address cannot be reused while the entry exists — its
# size, {arena offset: (bytes, CRCs)}).  An entry lives from the end of a
# staging copy until the save's ``write_data`` has used it
# (:func:`forget_staged_checksums`), the next staging into that arena starts,
# or the arena is closed: the CRCs are only ever used by the save they were
# staged for.
_STAGED_CRCS: "collections.OrderedDict[int, tuple[Any, int, dict[int, tuple[int, np.ndarray]]]]" = (
    collections.OrderedDict()
)
_STAGED_CRCS_LOCK = threading.Lock()
_STAGED_CRCS_KEEP = 4


def _remember_checksums(buf: Any, address: int, size: int, crcs: dict[int, tuple[int, np.ndarray]]) -> None:
    with _STAGED_CRCS_LOCK:
        _STAGED_CRCS.pop(address, None)
        if crcs:
            _STAGED_CRCS[address] = (buf, size, crcs)
            while len(_STAGED_CRCS) > _STAGED_CRCS_KEEP:
                _STAGED_CRCS.popitem(last=False)


def forget_staged_checksums(addresses: Any = None) -> None:
    """Drop the staging CRCs of the arenas at ``addresses`` (all when None)."""
    with _STAGED_CRCS_LOCK:
        if addresses is None:
            _STAGED_CRCS.clear()
        for a in addresses or ():
            _STAGED_CRCS.pop(a, None)


def staged_checksums(address: int, nbytes: int) -> tuple[int, np.ndarray] | None:
    """``(arena address, CRCs)`` of the tensor bytes at ``address`` if the
    staging copy that put exactly these ``nbytes`` there checksummed them
    (one CRC-32C per CHECKSUM_BLOCK_BYTES block from ``address``), else None."""
    with _STAGED_CRCS_LOCK:
        for base, (_, size, crcs) in _STAGED_CRCS.items():
            if base <= address < base + size:
                hit = crcs.get(address - base)
                if hit is not None and hit[0] == nbytes:
                    return base, hit[1]
                return None
    return None


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


def _attach(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    """Map another process's shared arena (cached: the same arena serves
    every save of that writer)."""
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


def _attach_spill(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    nfd = _open_other(pid, fd, token, _SPILL_PREFIX, os.O_RDONLY)
    try:
        return mmap.mmap(nfd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(nfd)


class _Spill:
    """The unlinked file that tensors past the memory limit stream into."""

    def __init__(self, directory: str, options: Any) -> None:
        from fp_dcp.engine import IOSession

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
        return (os.getpid(), self.fd, self.token, self.size)

    def close(self) -> None:
        self.session.close()
        os.close(self.fd)


# ------------------------------------------------------------ state-dict walk


def _walk(obj: Any, leaves: list[torch.Tensor], values: list[Any]) -> tuple:
    """The skeleton of ``obj``: containers kept, tensors replaced by their leaf
    index, anything else by its index in ``values``.  Comparable with ``==``."""
    if DTensor is not None and isinstance(obj, DTensor):
        leaves.append(_dcp_hooks.dtensor_local(obj))
        return ("D", len(leaves) - 1, _dcp_hooks.dtensor_spec(obj))
    if (
        isinstance(obj, torch.Tensor)
        and (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)
        and obj.layout == torch.strided
    ):
        leaves.append(obj.detach())
        return ("T", len(leaves) - 1)
    t = type(obj)
    if t is dict or t is collections.OrderedDict:
        return ("M", t, tuple((k, _walk(v, leaves, values)) for k, v in obj.items()))
    if t is list or t is tuple:
        return ("L" if t is list else "U", tuple(_walk(v, leaves, values) for v in obj))
    values.append(obj)  # other tensor subclasses and layouts included: deep-copied
    return ("V", len(values) - 1)


def _build(node: tuple, tensors: list[torch.Tensor], values: list[Any], top: bool = False) -> Any:
    kind = node[0]
    if kind == "T":
        return tensors[node[1]]
    if kind == "D":
        return _make_dtensor(tensors[node[1]], node[2])
    if kind == "M":
        out = _StagedStateDict() if top else node[1]()
        for k, sub in node[2]:
            out[k] = _build(sub, tensors, values)
        return out
    if kind == "L":
        return [_build(sub, tensors, values) for sub in node[1]]
    if kind == "U":
        return tuple(_build(sub, tensors, values) for sub in node[1])
    return values[node[1]]


def _make_dtensor(local: torch.Tensor, spec: Any) -> Any:
    return _dcp_hooks.dtensor_from_spec(local, spec)


def _meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.device)


def _flat_bytes(t: torch.Tensor) -> np.ndarray | None:
    """A uint8 numpy view of a contiguous CPU tensor's bytes; None if a plain
    memcpy cannot copy it."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.layout != torch.strided:
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


# ------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _Layout:
    metas: tuple
    nbytes: tuple[int, ...]
    where: tuple[int, ...]
    offset: tuple[int, ...]  # in the arena, or in the spill file
    arena_bytes: int  # header + resident tensors (+ ring)
    ring_offset: int
    slot_bytes: int  # 0: everything fits
    spill_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(self.nbytes)


def _plan(metas: tuple, options: Any, alignment: int) -> _Layout:
    nbytes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for dtype, shape, _ in metas]
    threshold, packed = options.pack_threshold_bytes, options.pack_alignment_bytes

    def fill(budget: int | None) -> tuple[list[int], list[int], int, int]:
        """Tensors in the arena (first fit, page 0 the header) while they end
        within ``budget`` (None: all of them), the others in the spill file:
        (where, offset, arena end, spill end)."""
        where, offset = [], []
        pos, spos = alignment, 0
        for n in nbytes:
            if n == 0:
                where.append(_EMPTY)
                offset.append(0)
                continue
            off = align_up(pos, alignment if n >= threshold else packed)
            if budget is None or off + n <= budget:
                where.append(_ARENA)
                offset.append(off)
                pos = off + n
            else:
                soff = align_up(spos, alignment)
                where.append(_SPILL)
                offset.append(soff)
                spos = soff + n
        return where, offset, align_up(pos, alignment), align_up(spos, alignment)

    where, offset, full, _ = fill(None)
    cap = options.staging_memory_limit_bytes
    if cap is None or full <= cap:
        return _Layout(metas, tuple(nbytes), tuple(where), tuple(offset), full, full, 0, 0)

    # Past the limit: two ring slots, the rest of the budget for resident tensors.
    slot = min(options.cuda_chunk_bytes, (cap - alignment) // 4) // alignment * alignment
    budget = (cap - 2 * slot) // alignment * alignment
    if slot < alignment or budget < alignment:
        raise ValueError(
            f"FastPersistOptions.staging_memory_limit_bytes={cap} is too small to stream "
            f"through: allow at least {5 * alignment} bytes"
        )
    where, offset, ring, spill = fill(budget)
    return _Layout(metas, tuple(nbytes), tuple(where), tuple(offset), ring + 2 * slot, ring, slot, spill)


# --------------------------------------------------------- the staged dict


class _StagedStateDict(dict):
    """The staged state dict: a plain dict to DCP; pickles (PROCESS mode) as
    one handle to the arena instead of one shared segment per tensor."""

    _fp_snapshot: "_Snapshot | None" = None

    def __reduce_ex__(self, protocol: int) -> Any:
        snap = self._fp_snapshot
        if snap is None:
            return (dict, (dict(self),))
        return snap.reduce(self)


@dataclasses.dataclass
class _Snapshot:
    stager: "_Stager"
    rec: _Save
    arena: "_Arena"
    layout: _Layout
    skeleton: tuple
    values: list[Any]
    spill: tuple | None  # handle of the spill file when tensors were spilled
    shared_option: bool | None
    crcs: dict[int, tuple[int, np.ndarray]]  # the staging copy's checksums, by arena offset

    def reduce(self, staged: dict) -> Any:
        self.rec.process = True
        if self.rec.thread is None:
            self.rec.thread = threading.current_thread()
        if self.shared_option is False:
            # torch pickles each tensor by moving its storage to a shared
            # segment: hand it fresh views, not the ones cached for reuse.
            fresh = _views(self.arena.buf, _attach_spill(*self.spill) if self.spill else None, self.layout)
            return (dict, (dict(_build(self.skeleton, fresh, self.values)),))
        arena = self.stager.share(self)
        return (_rebuild, (arena.handle(), self.spill, self.layout, self.skeleton, self.values, self.crcs))


def _rebuild(arena: tuple, spill: tuple | None, layout: _Layout, skeleton: tuple, values: list[Any],
             crcs: dict[int, tuple[int, np.ndarray]] | None = None) -> dict:
    """Unpickling in the checkpoint process: views into the trainer's arena
    (and the staging copy's checksums, for this process's writer)."""
    buf = _attach(*arena)
    _remember_checksums(buf, _buffer_address(buf), arena[3], crcs or {})
    smap = _attach_spill(*spill) if spill is not None else None
    return _build(skeleton, _views(buf, smap, layout), values)


def _views(buf: Any, spill_map: Any, layout: _Layout) -> list[torch.Tensor | None]:
    """Tensors viewing the arena (and the spill mapping; None without one)."""
    out: list[torch.Tensor | None] = []
    for (dtype, shape, _), where, off, n in zip(layout.metas, layout.where, layout.offset, layout.nbytes):
        if where == _EMPTY:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        src = buf if where == _ARENA else spill_map
        if src is None:
            out.append(None)
            continue
        out.append(torch.frombuffer(src, dtype=dtype, count=n // dtype.itemsize, offset=off).view(shape))
    return out


class _StagingFuture(concurrent.futures.Future):
    """The future lazy ``stage`` returns.

    ``dcp.async_save`` (torch 2.13) turns it into ``staging_completion`` with
    ``if not f.done(): f.add_done_callback(pass_outcome_on) else:
    staging_completion.set_result(None)`` — a staging that failed before that
    check would read as a success.  So a *failed* future reports ``done()``
    False until a callback has been attached to it (a callback attached to a
    done future runs at once and passes the failure on).  Only DCP sees this
    future: ``result()`` and ``exception()`` behave as usual.  (Listed with
    fp_dcp's other dependencies on torch internals in :mod:`fp_dcp._dcp_hooks`.)"""

    _watched = False

    def done(self) -> bool:
        finished = super().done()
        if finished and not self._watched and super().exception(timeout=0) is not None:
            return False
        return finished

    def add_done_callback(self, fn: Callable) -> None:
        self._watched = True
        super().add_done_callback(fn)


# ------------------------------------------------------------------ the stager


class _Stager:
    """A writer's staging state: arena, layout, saves in flight."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.arena: _Arena | None = None
        self.spill: _Spill | None = None
        self.layout: _Layout | None = None
        self.views: list[torch.Tensor] | None = None  # resident views of (arena, layout)
        self.shared = False  # stage into shared memory (PROCESS mode seen, or asked for)
        self.seq = 0
        self.saves: collections.deque[_Save] = collections.deque()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.ring_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.copy_piece = _COPY_PIECE
        self.streams: dict[torch.device, Any] = {}
        self.last_future: weakref.ref | None = None
        self.last_stats: dict[str, Any] = {}
        self.closed = False
        self.before_copy: Callable[[], None] | None = None  # test hook: runs just before the copy
        self.checkpoint_hint: str | None = None

    # ---------------------------------------------------------------- stage

    def stage(self, writer: Any, state_dict: dict[str, Any]) -> Any:
        options = writer.options
        mode = options.staging
        if self.closed:
            raise RuntimeError("FastPersistWriter is closed")
        if not isinstance(state_dict, dict):
            raise TypeError(f"stage() takes a state dict, not {type(state_dict).__name__}")
        via_async_save, self.checkpoint_hint = _dcp_hooks.async_save_caller()
        leaves: list[torch.Tensor] = []
        values: list[Any] = []
        skeleton = _walk(state_dict, leaves, values)
        values = copy.deepcopy(values)
        metas = tuple(_meta(t) for t in leaves)
        events = self._cuda_events(leaves)
        with self.lock:
            prev = self.saves[-1] if self.saves else None
            self.seq += 1
            rec = _Save(self.seq)
            rec.via_async_save = via_async_save
            self.saves.append(rec)
            while self.saves and self.saves[0].done.is_set() and self.saves[0] is not prev:
                self.saves.popleft()
        if mode == "eager":
            # The training waits for an eager copy: use the cores it would use.
            rec.copy_threads = max(1, min(torch.get_num_threads(), _MAX_COPY_THREADS))
            try:
                self._wait(prev)
                staged = self._stage_now(writer, rec, skeleton, metas, leaves, values, events)
            except BaseException as e:
                rec.finish(e, reported=True)  # raised here: nothing to report later
                raise
            return staged
        # A lazy copy overlaps the forward/backward pass: one thread (the
        # default), leaving the other cores to the training.
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-stage")
        fut = _StagingFuture()
        rec.refs.append(weakref.ref(fut))
        self.last_future = weakref.ref(fut)
        self.pool.submit(self._stage_later, writer, rec, prev, fut, skeleton, metas, leaves, values, events)
        return fut

    def _stage_later(self, writer, rec, prev, fut, skeleton, metas, leaves, values, events) -> None:
        try:
            self._wait(prev)
            staged = self._stage_now(writer, rec, skeleton, metas, leaves, values, events)
        except _PreviousSaveFailed as e:
            rec.finish(e, reported=True)
            fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - handed to the future
            rec.finish(e)
            fut.set_exception(e)
        else:
            fut.set_result(staged)

    def _wait(self, prev: _Save | None) -> None:
        """Wait until the previous save on this writer is done; raise its
        failure once."""
        if prev is None:
            return
        prev.wait()
        if prev.error is not None and not prev.reported:
            prev.reported = True
            raise _PreviousSaveFailed(
                f"the previous async save on this FastPersistWriter failed, so this one was not "
                f"started: {type(prev.error).__name__}: {prev.error}"
            ) from prev.error

    def _stage_now(self, writer, rec: _Save, skeleton, metas, leaves, values, events) -> dict:
        t0 = time.perf_counter()
        options = writer.options
        # Each save gets a fresh save_id even when async_save passes no
        # checkpoint_id (DCP then does not call reset()).
        writer.reset()
        alignment = max(_PAGE, options.alignment_bytes or 0)
        with self.lock:
            if self.closed:
                raise RuntimeError("FastPersistWriter is closed")
            if options.staging_shared_memory:
                self.shared = True
            layout = self.layout
            if layout is None or layout.metas != metas or self._options_key(options) != self._layout_key:
                layout = _plan(metas, options, alignment)
                self._layout_key = self._options_key(options)
            grown = self._ensure_arena(layout, alignment, options)
            arena = self.arena
            if any(m[2].type == "cuda" for m in metas):
                arena.register_cuda()
            if self.layout is not layout or self.views is None:
                self.views = None
                self.layout = layout
                self.views = _views(arena.buf, None, layout)
            _write_status(arena.buf, rec.seq, _PENDING)
            rec.arena = arena
        forget_staged_checksums([arena.address])
        if self.before_copy is not None:
            self.before_copy()
        spill_handle = None
        spill_map = None
        tensors = self.views
        block = fmt.CHECKSUM_BLOCK_BYTES if options.write_checksums and options.staging_checksums else 0
        if layout.spill_bytes:
            spill = self._spill_file(writer, options)
            crcs = self._copy(arena, layout, leaves, events, spill, rec.copy_threads, block)
            spill_map = spill.mapping()
            spill_handle = spill.handle()
            tensors = [v if w != _SPILL else t for v, w, t in zip(tensors, layout.where, _views(None, spill_map, layout))]
        else:
            crcs = self._copy(arena, layout, leaves, events, None, rec.copy_threads, block)
        _remember_checksums(arena.buf, arena.address, arena.size, crcs)
        staged = _build(skeleton, tensors, values, top=True)
        staged._fp_snapshot = _Snapshot(
            self, rec, arena, layout, skeleton, values, spill_handle, options.staging_shared_memory, crcs
        )
        rec.refs.append(weakref.ref(staged))
        rec.snapshot = weakref.ref(staged._fp_snapshot)
        rec.staged = True
        seconds = time.perf_counter() - t0
        self.last_stats = {
            "seconds": seconds,
            "bytes": layout.payload_bytes,
            "gbps": layout.payload_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "arena_bytes": arena.size,
            "arena_allocated": grown,
            "arena_shared": arena.shared,
            "arena_locked": arena.locked,
            "spilled_bytes": sum(n for n, w in zip(layout.nbytes, layout.where) if w == _SPILL),
            "tensors": len(leaves),
        }
        return staged

    @staticmethod
    def _options_key(options: Any) -> tuple:
        return (
            options.staging_memory_limit_bytes,
            options.pack_threshold_bytes,
            options.pack_alignment_bytes,
            options.alignment_bytes,
            options.cuda_chunk_bytes,
        )

    _layout_key: tuple | None = None

    def _ensure_arena(self, layout: _Layout, alignment: int, options: Any) -> bool:
        a = self.arena
        if a is not None and a.size >= layout.arena_bytes and a.shared == self.shared:
            cap = options.staging_memory_limit_bytes
            if cap is None or a.size <= cap:
                return False
        self.views = None
        if a is not None:
            a.close()
            self.arena = None
        self.arena = _Arena(layout.arena_bytes, alignment, self.shared)
        return True

    def _spill_file(self, writer: Any, options: Any) -> _Spill:
        directory = options.staging_spill_dir or self.checkpoint_hint or writer.path
        if directory is None:
            raise ValueError(
                "the state dict exceeds FastPersistOptions.staging_memory_limit_bytes and the writer "
                "has no directory to spill into: set staging_spill_dir or FastPersistWriter(path)"
            )
        s = self.spill
        if s is not None and s.directory != directory:
            # A new checkpoint directory each save: keep the spill file (and
            # its engine) while the new one is on the same file system.
            os.makedirs(directory, exist_ok=True)
            if os.stat(directory).st_dev != s.dev:
                s.close()
                self.spill = s = None
        if s is None:
            self.spill = s = _Spill(directory, options)
        s.drop_cache()
        return s

    # ------------------------------------------------------------------ copy

    def _cuda_events(self, leaves: list[torch.Tensor]) -> dict:
        """On the calling (training) thread: mark where each device's current
        stream is, so the side-stream copies start after the work queued so far."""
        devices = {t.device for t in leaves if t.device.type == "cuda"}
        events = {}
        for d in devices:
            if d not in self.streams:
                self.streams[d] = torch.cuda.Stream(device=d)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events[d] = ev
        return events

    def _copy(self, arena: _Arena, layout: _Layout, leaves, events: dict, spill: _Spill | None, threads: int,
              block: int = 0) -> dict[int, tuple[int, np.ndarray]]:
        """Copy the leaves into the arena (and the spill file); returns the
        CRC-32C of every ``block`` bytes of each tensor that a CPU memcpy
        copied (``{arena offset: (bytes, CRCs)}``; empty when ``block`` is 0)."""
        offsets: list[int] = []
        sources: list[np.ndarray] = []
        slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        views = self.views
        for i, t in enumerate(leaves):
            if layout.where[i] != _ARENA:
                continue
            if t.device.type == "cuda":
                cuda.setdefault(t.device, []).append((views[i], t))
                continue
            b = _flat_bytes(t) if t.device.type == "cpu" else None
            if b is None:
                slow.append((views[i], t))
            else:
                offsets.append(layout.offset[i])
                sources.append(b)
        done = []
        for d, pairs in cuda.items():  # queued first: the DMA runs while the CPU copies
            s = self.streams[d]
            with torch.cuda.device(d), torch.cuda.stream(s):
                s.wait_event(events[d])
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(s)
                ev = torch.cuda.Event()
                ev.record(s)
                done.append(ev)
        crcs: dict[int, tuple[int, np.ndarray]] = {}
        if sources:
            got = self._gather(arena, offsets, sources, threads, block)
            if got is not None:
                crcs = {off: (len(b), c) for off, b, c in zip(offsets, sources, got)}
        for dst, src in slow:
            dst.copy_(src)
        for ev in done:
            ev.synchronize()
        del views
        if spill is not None:
            self._stream(arena, layout, leaves, events, spill)
        return crcs

    def _gather(self, arena: _Arena, offsets: list[int], sources: list[np.ndarray], threads: int,
                block: int = 0) -> list[np.ndarray] | None:
        """memcpy every source to its arena offset, the GIL released; split
        over ``threads`` threads (eager staging: the training is waiting
        anyway) in pieces of at most ``self.copy_piece`` bytes.  With
        ``block``, the copy also checksums every ``block`` bytes of each
        source (fused: one pass over memory) and returns them per source."""
        k = threads
        piece_max = self.copy_piece
        if block and piece_max % block:
            block = 0  # pieces must cut sources on the checksum grid
        total = sum(len(b) for b in sources)
        if k <= 1 or total < 2 * piece_max:
            got = _native.copy_gather(arena.buf, np.asarray(offsets, dtype=np.int64), sources, checksum_block=block)
            if not block:
                return None
            crcs, first = got
            return [crcs[a:b] for a, b in zip(first[:-1].tolist(), first[1:].tolist())]
        groups: list[tuple[list[int], list[np.ndarray], list[tuple[int, int]]]] = [([], [], []) for _ in range(k)]
        loads = [0] * k
        for si, (off, b) in enumerate(zip(offsets, sources)):
            for lo in range(0, len(b), piece_max):
                g = loads.index(min(loads))
                piece = b[lo : lo + piece_max]
                groups[g][0].append(off + lo)
                groups[g][1].append(piece)
                groups[g][2].append((si, lo))
                loads[g] += len(piece)
        if self.copy_pool is None or self.copy_pool._max_workers < k - 1:
            if self.copy_pool is not None:
                self.copy_pool.shutdown(wait=True)
            self.copy_pool = concurrent.futures.ThreadPoolExecutor(k - 1, thread_name_prefix="fp_dcp-copy")
        futs = [
            self.copy_pool.submit(_native.copy_gather, arena.buf, np.asarray(o, dtype=np.int64), b, block)
            for o, b, _ in groups[1:]
        ]
        results = []
        try:
            results.append(_native.copy_gather(arena.buf, np.asarray(groups[0][0], dtype=np.int64), groups[0][1], block))
        finally:
            results += [f.result() for f in futs]
        if not block:
            return None
        out = [np.zeros(max(1, -(-len(b) // block)), dtype=np.uint32) for b in sources]
        for (_, _, where), (crcs, first) in zip(groups, results):
            for (si, lo), a, b in zip(where, first[:-1].tolist(), first[1:].tolist()):
                out[si][lo // block : lo // block + b - a] = crcs[a:b]
        return out

    def _stream(self, arena: _Arena, layout: _Layout, leaves, events: dict, spill: _Spill) -> None:
        """Tensors past the limit: copy a slot, write it while the next slot is
        copied, wait for a slot's write before copying into it again."""
        spill.resize(layout.spill_bytes)
        items = []
        for i, t in enumerate(leaves):
            if layout.where[i] != _SPILL:
                continue
            if t.device.type == "cuda":
                st = self.streams[t.device]
                with torch.cuda.device(t.device), torch.cuda.stream(st):
                    st.wait_event(events[t.device])
                    src: Any = t.contiguous().reshape(-1).view(torch.uint8)
                    t.record_stream(st)
            else:
                src = _flat_bytes(t)
                if src is None:
                    src = _flat_bytes(t.resolve_conj().resolve_neg().contiguous().cpu())
            items.append((layout.offset[i], layout.nbytes[i], src, t.device))
        if self.ring_pool is None:
            self.ring_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-spill")
        slot = layout.slot_bytes
        pending: list[concurrent.futures.Future | None] = [None, None]
        try:
            for k, start in enumerate(range(0, layout.spill_bytes, slot)):
                s = k % 2
                if pending[s] is not None:
                    pending[s].result()  # back-pressure: the slot is free again
                    pending[s] = None
                stop = min(start + slot, layout.spill_bytes)
                base = layout.ring_offset + s * slot
                offs, srcs, evs = [], [], []
                for off, n, src, dev in items:
                    a, b = max(off, start), min(off + n, stop)
                    if b <= a:
                        continue
                    if dev.type == "cuda":
                        st = self.streams[dev]
                        with torch.cuda.device(dev), torch.cuda.stream(st):
                            host = torch.frombuffer(arena.buf, dtype=torch.uint8, count=b - a, offset=base + a - start)
                            host.copy_(src[a - off : b - off], non_blocking=True)
                            ev = torch.cuda.Event()
                            ev.record(st)
                            evs.append(ev)
                    else:
                        offs.append(base + a - start)
                        srcs.append(src[a - off : b - off])
                if srcs:
                    _native.copy_gather(arena.buf, np.asarray(offs, dtype=np.int64), srcs)
                for ev in evs:
                    ev.synchronize()
                view = memoryview(arena.buf)[base : base + (stop - start)]
                pending[s] = self.ring_pool.submit(spill.write, start, view)
            for k in range(2):
                if pending[k] is not None:
                    pending[k].result()
                    pending[k] = None
        finally:
            for p in pending:
                if p is not None:
                    p.exception()  # no write may outlive this call

    # ---------------------------------------------------------- PROCESS mode

    def share(self, snap: _Snapshot) -> _Arena:
        """The arena a pickled snapshot refers to, moved to shared memory on
        first use (auto mode); later saves stage into shared memory directly."""
        with self.lock:
            arena = snap.arena
            if arena.closed:
                raise RuntimeError(
                    "the FastPersistWriter was closed before the checkpoint process received the "
                    "staged state dict; wait for the async_save future before close()"
                )
            if arena.shared:
                return arena
            shared = _Arena(arena.size, _PAGE, True)
            if arena.cuda_registered:
                shared.register_cuda()
            _native.copy_gather(shared.buf, np.zeros(1, np.int64), [arena.buf])
            self.shared = True
            if self.arena is arena:
                self.views = None
                self.layout = None
                self.arena = shared
                arena.close()
            snap.arena = shared
            snap.rec.arena = shared
            _remember_checksums(shared.buf, shared.address, shared.size, snap.crcs)
            return shared

    def report_handle(self) -> tuple | None:
        """Where the pickled writer copy reports the outcome of the save being
        pickled (the newest one)."""
        with self.lock:
            for rec in reversed(self.saves):
                if not rec.staged or rec.done.is_set():
                    continue
                snap = rec.snapshot() if rec.snapshot is not None else None
                if snap is None or snap.shared_option is False:
                    return None
                rec.process = True
                if rec.thread is None:
                    rec.thread = threading.current_thread()
                arena = self.share(snap)
                rec.reporting = True
                return (*arena.handle(), rec.seq, {})
        return None

    # --------------------------------------------------------- hooks, waits

    def track(self, name: str, args: tuple, kwargs: dict) -> _Track | None:
        me = threading.current_thread()
        with self.lock:
            for rec in self.saves:
                if not rec.done.is_set() and rec.thread is me:
                    return _Track(rec, name, args, kwargs)
            if name != "set_up_storage_writer":
                return None
            for rec in self.saves:
                if not rec.done.is_set() and rec.thread is None and rec.staged:
                    rec.thread = me
                    return _Track(rec, name, args, kwargs)
        return None

    def synchronize(self) -> None:
        ref = self.last_future
        fut = ref() if ref is not None else None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # lazy staging in progress
        for rec in list(self.saves):
            # Saves that started, or that async_save handed to its executor; a
            # dict from a direct stage() call that no save picked up keeps its views.
            if rec.thread is not None or rec.via_async_save:
                rec.wait()
        if self.ring_pool is not None:
            self.ring_pool.shutdown(wait=True)
        if self.copy_pool is not None:
            self.copy_pool.shutdown(wait=True)
        with self.lock:
            self.saves.clear()
            self.views = None
            self.layout = None
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            if self.spill is not None:
                self.spill.close()
                self.spill = None
            self.streams.clear()

