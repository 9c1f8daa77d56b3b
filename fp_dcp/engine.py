"""The facade over the native engine ``fp_dcp._aio``: an engine configured for
a directory, data files, zero-copy byte buffers of tensors, and page-locked
buffers registered with CUDA."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import re
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from fp_dcp import _exit, _native, pinned, tuning
from fp_dcp.options import FastPersistOptions, parse_size

__all__ = ["IOSession", "EngineSet", "tensor_bytes", "contiguous_bytes", "PinnedBuffer", "device_max_request_bytes",
           "device_iops_limits", "large_read_shape", "read_shape", "write_shape", "release_bounce_buffers"]

# The reader's engine of large requests: one request as large as the device
# takes in one piece (``max_sectors_kb``), within these bounds, and this many
# bytes in flight (docs/NATIVE.md, "Request sizes").
LARGE_REQUEST_MIN_BYTES = 1 << 20
LARGE_REQUEST_MAX_BYTES = 4 << 20
LARGE_IN_FLIGHT_BYTES = 32 << 20

# The writer's requests and the reader's of long runs where nothing sets
# their shape (docs/NATIVE.md, "Request sizes"): 1 MiB x 32, or, where this
# process's cgroup limits the disk's operations per second in that
# direction, larger requests (a quarter of the operations for the same
# 32 MiB in flight): 4 MiB x 8 for writes, large_read_shape for reads.
SHAPE_WITHOUT_LIMIT = (1 << 20, 32)
WRITE_SHAPE_UNDER_LIMIT = (4 << 20, 8)


KEEP_BOUNCE_BUFFERS_ENV = "FP_DCP_KEEP_BOUNCE_BUFFERS"


def keep_bounce_buffers_from_env() -> None:
    """Apply ``$FP_DCP_KEEP_BOUNCE_BUFFERS`` (a size, ``64MiB``; ``0``: keep
    none; unset: 256 MiB) to the bounce buffers closed engines keep."""
    raw = os.environ.get(KEEP_BOUNCE_BUFFERS_ENV)
    if raw is None or not raw.strip():
        limit = _native.DEFAULT_KEEP_POOL_BYTES
    else:
        try:
            limit = parse_size(raw)
        except ValueError as e:
            raise ValueError(f"{KEEP_BOUNCE_BUFFERS_ENV}={raw!r}: {e}; 0 keeps none") from None
    _native.set_keep_limit(min(limit, sys.maxsize))  # (more than the address space: no limit)


def release_bounce_buffers() -> None:
    """Free now the bounce buffers that closed writers' and readers' engines
    left for the next engine of their shape (faulted in and page-locked: a
    next save does not wait for their first touch).  At most
    ``$FP_DCP_KEEP_BOUNCE_BUFFERS`` bytes (256 MiB unless set; 0: none) are
    kept; they are the process's until this call or its exit."""
    _native.release_kept_pools()


def device_max_request_bytes(directory: str) -> int | None:
    """The largest request the block device under ``directory`` takes whole
    (``/sys/block/<disk>/queue/max_sectors_kb``), or None where sysfs does not
    say (tmpfs, network file systems, no sysfs)."""
    try:
        disk = tuning.block_device(directory)[1]
        text = tuning.read_sysfs(os.path.join(disk, "queue", "max_sectors_kb")) if disk is not None else None
        return int(text) << 10 if text else None
    except (OSError, ValueError):
        return None


def _disk_devs(directory: str) -> set[str]:
    """"major:minor" of the file system under ``directory`` and of its whole
    disk (a partition's parent), as cgroups name block devices."""
    dev, disk = tuning.block_device(directory)
    whole = tuning.read_sysfs(os.path.join(disk, "dev")) if disk is not None else None
    return {dev, whole} if whole else {dev}


# the most read of a /proc or cgroup file (a host's mountinfo with thousands
# of mounts is some hundred KiB; a cgroup file is a few lines)
_PROC_FILE_BYTES = 4 << 20


def _read_text(path: str) -> str:
    """A /proc or cgroup file's text, up to ``_PROC_FILE_BYTES`` (these
    return their text in pieces); "" where it does not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return ""
    parts: list[bytes] = []
    size = 0
    try:
        while size < _PROC_FILE_BYTES:
            part = os.read(fd, min(1 << 16, _PROC_FILE_BYTES - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return b"".join(parts).decode("utf-8", "replace")


def _unescape_mount_path(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dirs() -> list[tuple[str, str]]:
    """(version, directory) of this process's own blkio (v1) and unified (v2)
    cgroups and of each of their ancestors up to the mount, from
    /proc/self/cgroup and /proc/self/mountinfo; [] where they do not say."""
    v1_path = v2_path = None
    for line in _read_text("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "blkio" in parts[1].split(","):
            v1_path = parts[2]
    dirs: list[tuple[str, str]] = []
    for line in _read_text("/proc/self/mountinfo").splitlines():
        fields = line.split(" ")
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1:]
        if len(tail) < 3:
            continue
        fstype, super_options = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "blkio" in super_options and v1_path is not None:
            version, path = "v1", v1_path
        elif fstype == "cgroup2" and v2_path is not None:
            version, path = "v2", v2_path
        else:
            continue
        root, mountpoint = _unescape_mount_path(fields[3]), _unescape_mount_path(fields[4])
        inside = path == root or root == "/" or path.startswith(root.rstrip("/") + "/")
        rel = path[len(root):] if inside else ""  # (a group outside the mounted part: its mount's root)
        d = os.path.normpath(mountpoint + "/" + rel.strip("/")) if rel.strip("/") else mountpoint
        while True:
            dirs.append((version, d))
            if d == mountpoint or len(d) <= len(mountpoint):
                break
            d = os.path.dirname(d)
    return dirs


def device_iops_limits(directory: str) -> dict[str, int]:
    """``{"read": n, "write": n}``: the lowest operations-per-second limit
    that this process's cgroups (v1 ``blkio.throttle.{read,write}_iops_device``,
    v2 ``io.max``'s ``riops`` / ``wiops``; its own group and every ancestor)
    set on the disk under ``directory``; a direction without one is absent."""
    devs = _disk_devs(directory)
    limits: dict[str, int] = {}

    def note(direction: str, value: str) -> None:
        if value.isdigit() and int(value) > 0:
            limits[direction] = min(int(value), limits.get(direction, int(value)))

    for version, d in _cgroup_dirs():
        if version == "v1":
            for direction in ("read", "write"):
                for line in _read_text(os.path.join(d, f"blkio.throttle.{direction}_iops_device")).splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] in devs:
                        note(direction, parts[1])
        else:
            for line in _read_text(os.path.join(d, "io.max")).splitlines():
                parts = line.split()
                if parts and parts[0] in devs:
                    for kv in parts[1:]:
                        key, _, value = kv.partition("=")
                        if key in ("riops", "wiops"):
                            note("read" if key == "riops" else "write", value)
    return limits


def _aligned(shape: tuple[int, int], alignment: int) -> tuple[int, int]:
    block, depth = shape
    return max(alignment, block // alignment * alignment), depth


def write_shape(directory: str, alignment: int) -> tuple[int, int]:
    """(block size, queue depth) of a writer's requests to ``directory`` where
    neither options nor a tuning record set them: ``SHAPE_WITHOUT_LIMIT``, or
    ``WRITE_SHAPE_UNDER_LIMIT`` where this process's cgroup limits the disk's
    write operations (:func:`device_iops_limits`); the block a multiple of
    ``alignment``."""
    limited = "write" in device_iops_limits(directory)
    return _aligned(WRITE_SHAPE_UNDER_LIMIT if limited else SHAPE_WITHOUT_LIMIT, alignment)


def read_shape(directory: str, alignment: int) -> tuple[int, int]:
    """(block size, queue depth) of the reader's engine for long runs from
    ``directory`` where neither options nor a tuning record set it:
    ``SHAPE_WITHOUT_LIMIT``, or where this process's cgroup limits the disk's
    read operations, :func:`large_read_shape` of the device."""
    if "read" in device_iops_limits(directory):
        return large_read_shape(device_max_request_bytes(directory), alignment)
    return _aligned(SHAPE_WITHOUT_LIMIT, alignment)


def large_read_shape(max_request: int | None, alignment: int) -> tuple[int, int]:
    """(block size, queue depth) of the reader's engine for long runs: the
    device's largest whole request bounded to [1, 4] MiB (4 MiB where the
    device does not say), a multiple of ``alignment``, and enough requests
    for ``LARGE_IN_FLIGHT_BYTES`` in flight."""
    block = LARGE_REQUEST_MAX_BYTES if max_request is None else max_request
    block = min(max(block, LARGE_REQUEST_MIN_BYTES), LARGE_REQUEST_MAX_BYTES)
    block = max(alignment, block // alignment * alignment)
    return block, max(4, LARGE_IN_FLIGHT_BYTES // block)


def contiguous_bytes(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of the bytes of a contiguous, strided CPU tensor
    that is neither conjugated nor negated (the caller checks that)."""
    if t.dim() and t.stride(-1) == 1:  # (a size-1 last dimension may have any stride)
        return t.view(torch.uint8).numpy().reshape(-1)  # one torch op fewer than a flat view first
    if not t.numel():  # (an empty tensor may have any strides: no view of it is flat)
        return np.zeros(0, dtype=np.uint8)
    if t.numel() == 1:  # (one element may have any strides: t[::2] of one keeps stride 2, and so does its flat view)
        return t.as_strided((1,), (1,)).view(torch.uint8).numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_bytes(t: torch.Tensor, name: str) -> np.ndarray:
    """A 1-D uint8 numpy view of a CPU tensor's row-major bytes (no copy when
    ``t`` is contiguous; a contiguous copy otherwise)."""
    # the common case (a plain contiguous CPU tensor) in a few calls: a save
    # of thousands of small tensors makes one view per tensor
    if (
        t.is_cpu and t.layout == torch.strided and not t.requires_grad and t.is_contiguous()
        and not t.is_conj() and not t.is_neg() and t.numel() > 1  # (one element may have any stride)
    ):
        return contiguous_bytes(t)
    if t.layout != torch.strided:
        raise TypeError(
            f"{name}: fp_dcp stores strided tensors only, not {t.layout}; "
            f"convert it (e.g. .to_dense()) before saving"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # one element with any stride counts as contiguous
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


class PinnedBuffer:
    """A page-aligned, pre-faulted, page-locked host buffer; registered with
    CUDA (``cudaHostRegister``, :mod:`fp_dcp.pinned`) when CUDA is available
    so device-to-host copies into it are DMA transfers."""

    def __init__(self, size: int, alignment: int) -> None:
        self.raw = _native.AlignedBuffer(size, alignment)
        self.size = size
        self.cuda_registered = torch.cuda.is_available() and pinned.cuda_register(
            self.raw.address, size, "device-to-host copy buffer"
        )
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8, count=size)

    def close(self) -> None:
        if self.raw is None:
            return
        self.tensor = torch.empty(0, dtype=torch.uint8)  # drops its view of the buffer
        if self.cuda_registered:
            pinned.cuda_unregister(self.raw.address)
            self.cuda_registered = False
        self.raw.close()
        self.raw = None


# Errors of a probe file that the directory refuses to hold (loads still work).
_CANNOT_CREATE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _direct_open_works(directory: str) -> bool:
    """Whether an existing regular file of ``directory`` opens with O_DIRECT."""
    with os.scandir(directory) as it:
        for entry in it:
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    return False
                continue
            os.close(fd)
            return True
    return False


class IOSession:
    """An engine configured for one checkpoint directory, reused across saves
    and loads of the same writer or reader (its bounce buffers are allocated,
    pre-faulted and locked once)."""

    def __init__(self, options: FastPersistOptions, directory: str) -> None:
        self.options = options
        self.directory = directory
        self.dev = os.stat(directory).st_dev
        if options.alignment_bytes is not None:
            self.alignment = self.memory_alignment = options.alignment_bytes
        else:
            # The file system's direct-I/O minimum, raised to its preferred block
            # size so that no request straddles a physical block (no device RMW).
            try:
                probed = _native.probe_alignment(directory)
            except OSError as e:
                if e.errno not in _CANNOT_CREATE:
                    raise
                probed = (4096, 4096)  # a read-only directory: the safe default
            self.alignment = max(*probed, os.statvfs(directory).f_bsize)
            # What O_DIRECT asks of memory alone: a tensor that torch placed 64
            # bytes past a page goes straight to and from the device where the
            # device takes such addresses (NVMe: 4), through the bounce buffers
            # where it does not (512 on many virtual disks).
            self.memory_alignment = probed[0]  # (at most self.alignment, the max above)
        try:
            supported = _native.direct_io_supported(directory)
        except OSError as e:
            if e.errno not in _CANNOT_CREATE:
                raise
            # a read-only file system (a checkpoint mounted for loading): ask
            # one of its files instead of creating a probe
            supported = _direct_open_works(directory)
        if options.direct_io is True and not supported:
            raise OSError(
                22,
                "the file system refuses O_DIRECT but FastPersistOptions.direct_io=True; "
                "set direct_io=None to fall back to buffered I/O",
                directory,
            )
        self.direct = supported and options.direct_io is not False
        kind = options.engine
        if kind == "auto" and not self.direct:
            # Kernel AIO on a buffered fd blocks in io_submit; threads overlap.
            kind = "threads"
        kwargs = {"alignment": self.alignment, "memory_alignment": self.memory_alignment}
        # options that leave the engine's shape open take the write shape of
        # the device's tuning record (fp-dcp tune) where there is one, else
        # write_shape's rule; the read shape is long_run_shape's
        self.tuned = None
        if options.queue_depth is None and options.block_size_bytes is None:
            self.tuned = tuning.lookup(directory, self.alignment)
            block, depth = self.tuned.write if self.tuned is not None else write_shape(directory, self.alignment)
            kwargs.update(queue_depth=depth, block_size=block)
        if options.queue_depth is not None:
            kwargs["queue_depth"] = options.queue_depth
        if options.block_size_bytes is not None:
            kwargs["block_size"] = options.block_size_bytes
        self.engine = _native.Engine(kind, **kwargs)
        self.kind = self.engine.kind
        self._engine_kwargs = kwargs
        self._lock = threading.Lock()

    def twin(self) -> "IOSession":
        """A session with this one's probed settings and an engine of its own
        (an engine serves one thread at a time), for a second thread reading
        at the same time; close it when done."""
        twin = copy.copy(self)
        twin.engine = _native.Engine(self.kind, **self._engine_kwargs)
        twin._lock = threading.Lock()
        return twin

    def reshaped(self, queue_depth: int, block_size: int) -> "IOSession":
        """A session with this one's probed settings and an engine of its own
        with another request size and queue depth (the reader's engine of
        large requests); close it when done."""
        other = copy.copy(self)
        kwargs = dict(self._engine_kwargs, queue_depth=queue_depth, block_size=block_size)
        other.engine = _native.Engine(self.kind, **kwargs)
        other._engine_kwargs = kwargs
        other._lock = threading.Lock()
        return other

    def long_run_shape(self) -> tuple[int, int]:
        """(block size, queue depth) for reading long runs from this directory: its
        device's tuning record, else the built-in rule (:func:`read_shape`)."""
        tuned = self.tuned or tuning.lookup(self.directory, self.alignment)
        if tuned is not None:
            return tuned.read
        return read_shape(self.directory, self.alignment)

    def matches(self, options: FastPersistOptions, directory: str) -> bool:
        """Whether this session serves ``directory`` too (same options, same file
        system), so a new directory per save keeps the engine and its locked buffers."""
        if self.options != options:
            return False
        try:
            return os.stat(directory).st_dev == self.dev
        except OSError:
            return False

    @contextlib.contextmanager
    def open_files(self, paths: Sequence[str], mode: str) -> Iterator[list[int]]:
        """Open every path (O_DIRECT when the session uses it); close all on exit."""
        fds: list[int] = []
        try:
            for p in paths:
                fds.append(self.engine.open(p, mode, self.direct if self.direct else False))
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def write(self, paths, file_index, file_offset, sources, *, sync: bool, **kwargs: Any) -> dict:
        """``kwargs``: ``checksums``, ``checksum_origin`` (see ``Engine.write``)."""
        with self.open_files(paths, "w") as fds, self._lock:
            return self.engine.write(fds, list(paths), file_index, file_offset, sources, sync=sync, **kwargs)

    def write_fds(self, fds, paths, file_index, file_offset, sources, *, sync: bool, **kwargs: Any) -> dict:
        with self._lock:
            return self.engine.write(fds, list(paths), file_index, file_offset, sources, sync=sync, **kwargs)

    def read(self, paths, file_index, file_offset, dests, **kwargs: Any) -> dict:
        with self.open_files(paths, "r") as fds, self._lock:
            return self.engine.read(
                fds, list(paths), file_index, file_offset, dests, coalesce_gap=self.options.coalesce_gap_bytes,
                **kwargs,
            )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class EngineSet:
    """The engines a writer or reader keeps across its saves or loads, one per
    thread that does I/O at once: ``primary``, ``large`` and ``more``, ``twins``
    (for shared reads), and one per other data directory.  Closed together when
    the options or the file system change."""

    def __init__(self) -> None:
        _exit.install()  # a process that reads or writes with fp_dcp does not abort at exit (fp_dcp/_exit.py)
        keep_bounce_buffers_from_env()
        self.primary: IOSession | None = None
        self.large: IOSession | None = None
        self.more: list[IOSession] = []
        self.twins: list[tuple[IOSession, IOSession | None]] = []
        self.by_directory: dict[str, IOSession] = {}
        self._settling: threading.Thread | None = None
        self._ready: threading.Event | None = None

    def __reduce__(self) -> tuple:
        # engines stay with the process that made them: a copy starts empty
        return (EngineSet, ())

    def session(self, options: FastPersistOptions, directory: str) -> IOSession:
        """The primary session for ``directory``, made anew (with the sessions
        made from it) when ``options`` or the file system differ."""
        if self.primary is None or not self.primary.matches(options, directory):
            self._close_primary()
            self.primary = IOSession(options, directory)
        return self.primary

    def large_session(self, above_bytes: int) -> IOSession | None:
        """The engine of large requests for long runs (the primary session's
        :meth:`~IOSession.long_run_shape`); None where that shape's requests
        are no larger than ``above_bytes``."""
        assert self.primary is not None, "session() comes first"
        if self.large is None:
            block, qd = self.primary.long_run_shape()
            if block <= above_bytes:
                return None
            self.large = self.primary.reshaped(qd, block)
        return self.large

    def more_large(self, count: int) -> list[IOSession]:
        """``count`` more engines of large requests, beside ``large``."""
        assert self.large is not None, "large_session() comes first"
        while len(self.more) < count:
            self.more.append(self.large.twin())
        return self.more[:count]

    def twin(self, i: int) -> tuple[IOSession, IOSession | None]:
        """The ``i``-th other pair of (primary, large) sessions."""
        assert self.primary is not None, "session() comes first"
        while len(self.twins) <= i:
            self.twins.append((self.primary.twin(), self.large.twin() if self.large is not None else None))
        return self.twins[i]

    def for_directory(self, options: FastPersistOptions, directory: str) -> IOSession:
        """A session of its own for another directory (a writer's data directory)."""
        session = self.by_directory.get(directory)
        if session is None or not session.matches(options, directory):
            if session is not None:
                session.close()
            session = self.by_directory[directory] = IOSession(options, directory)
        return session

    def in_background(self, work: Callable[[], object], name: str,
                      then: Callable[[], object] | None = None) -> None:
        """Run ``work`` (setting engines up: making them, faulting in and
        page-locking their bounce buffers, whose first touch can stall for
        tens of ms) on a thread of its own while the caller goes on, then
        ``then``; :meth:`ready` waits for ``work``, :meth:`settled` for
        both.  ``then`` may only settle engines' pools (an engine's calls
        take each bounce buffer as it is faulted in).  Best effort: what
        fails there is raised by the engine call that needs it.  Nothing
        starts while an earlier one has not been waited for (the first call
        wins)."""
        if self._settling is not None:
            return
        ready = self._ready = threading.Event()

        def run() -> None:
            try:
                work()
            except BaseException:  # noqa: BLE001 - the engine call that needs it reports it
                pass
            finally:
                ready.set()
            if then is not None:
                try:
                    then()
                except BaseException:  # noqa: BLE001 - as above
                    pass

        self._settling = threading.Thread(target=run, name=name, daemon=True)
        self._settling.start()

    def ready(self) -> None:
        """Wait for :meth:`in_background`'s ``work``, not for its ``then``
        (the engines are made; their pools may still be settling)."""
        if self._ready is not None and self._settling is not threading.current_thread():
            self._ready.wait()

    def settle_early(self, sessions: Sequence[IOSession]) -> None:
        """:meth:`in_background`: the bounce buffers of ``sessions``."""
        self.in_background(lambda: [s.engine.settle_pool() for s in sessions if s.engine is not None],
                           "fp_dcp-settle")

    def settled(self) -> None:
        """Wait for :meth:`in_background` (before an engine call or a close;
        on its own thread, where making a session closes older ones, nothing
        to wait for)."""
        if self._settling is not None and self._settling is not threading.current_thread():
            self._settling.join()
            self._settling = self._ready = None

    def _close_primary(self) -> None:
        self.settled()
        for session in [*(s for pair in self.twins for s in pair), *self.more, self.large, self.primary]:
            if session is not None:
                session.close()
        self.primary, self.twins, self.large, self.more = None, [], None, []

    def close(self) -> None:
        self._close_primary()
        for session in self.by_directory.values():
            session.close()
        self.by_directory.clear()
