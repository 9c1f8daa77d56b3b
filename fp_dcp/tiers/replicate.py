"""Moving data files between ranks over the tiers' own group: every rank runs
the same transfer list in one global order (no deadlock), as uint8 chunks
over gloo or NCCL; received files are checked before they are named.
:class:`FileIO` does the O_DIRECT file side (docs/TIERS.md)."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import uuid
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fp_dcp import _native
from fp_dcp.engine import IOSession
from fp_dcp.options import FastPersistOptions
from fp_dcp.tiers import store
from fp_dcp.tiers.store import TMP_SUFFIX

__all__ = ["Transfer", "run_transfers", "group_device", "FileIO", "file_io_for"]

CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    name: str
    size: int


def group_device(group) -> torch.device:
    """Where the tensors of ``group``'s point-to-point calls live."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_transfers(
    transfers: list[Transfer],
    rank: int,
    group,
    read: Callable[[Transfer], np.ndarray],
    receive: Callable[[Transfer, np.ndarray], None],
    chunk_bytes: int = CHUNK_BYTES,
    receive_buffer: Callable[[Transfer], np.ndarray] | None = None,
) -> tuple[dict[str, int], dict[Transfer, str]]:
    """Run this rank's part of ``transfers`` (every rank holds the same list):
    ``read(t)`` gives a sent file's bytes, ``receive(t, data)`` takes a
    received one's (into ``receive_buffer(t)`` when given).  Returns the bytes
    sent and received and this rank's failed transfers with why; a failed read
    is announced to the receiver, so one bad file never stalls the others."""
    device = group_device(group)
    sent = received = 0
    failed: dict[Transfer, str] = {}

    def to_wire(t: torch.Tensor) -> torch.Tensor:
        return t if device.type == "cpu" else t.to(device)

    for t in transfers:
        if t.src == t.dst or rank not in (t.src, t.dst):
            continue
        if rank == t.src:
            try:
                data = read(t)
                if data.size < t.size:
                    raise OSError(f"{t.name}: {data.size} bytes, {t.size} expected")
            except Exception as e:  # noqa: BLE001 - reported to the receiver and the caller
                failed[t] = f"rank {rank} could not read it: {e}"
                dist.send(to_wire(torch.ones(1, dtype=torch.int64)), group_dst=t.dst, group=group)
                continue
            dist.send(to_wire(torch.zeros(1, dtype=torch.int64)), group_dst=t.dst, group=group)
            for start in range(0, t.size, chunk_bytes):
                dist.send(to_wire(torch.from_numpy(data[start: start + chunk_bytes])), group_dst=t.dst, group=group)
            sent += t.size
        else:
            status = to_wire(torch.zeros(1, dtype=torch.int64))
            dist.recv(status, group_src=t.src, group=group)
            if int(status.item()):
                failed[t] = f"rank {t.src} could not read it"
                continue
            data = np.empty(t.size, dtype=np.uint8) if receive_buffer is None else receive_buffer(t)
            for start in range(0, t.size, chunk_bytes):
                n = min(chunk_bytes, t.size - start)
                if device.type == "cpu":
                    dist.recv(torch.from_numpy(data[start: start + n]), group_src=t.src, group=group)
                else:
                    chunk = torch.empty(n, dtype=torch.uint8, device=device)
                    dist.recv(chunk, group_src=t.src, group=group)
                    data[start: start + n] = chunk.cpu().numpy()
            received += t.size
            try:
                receive(t, data)
            except Exception as e:  # noqa: BLE001 - the caller decides (next tier)
                failed[t] = str(e)
    return {"sent_bytes": sent, "received_bytes": received}, failed


class FileIO:
    """O_DIRECT reads and writes of whole data files (buffered where O_DIRECT is
    refused) through buffers kept for the next call.  One thread at a time;
    :meth:`close` frees the buffers."""

    def __init__(self, options: FastPersistOptions, directory: str) -> None:
        self.options = options
        self.session = IOSession(options, directory)
        self._buffers: dict[str, _native.AlignedBuffer] = {}

    def matches(self, directory: str) -> bool:
        return self.session.matches(self.options, directory)

    def buffer(self, size: int, role: str = "receive") -> np.ndarray:
        """``size`` writable bytes of this role's buffer, valid until the
        next call for the same role (allocated, and prefaulted, only when it
        grows)."""
        buf = self._buffers.get(role)
        if buf is None or len(buf) < size:
            a = self.session.alignment
            self._buffers[role] = buf = _native.AlignedBuffer(-(-max(size, 1) // a) * a, a, lock=False)
        return np.frombuffer(buf, dtype=np.uint8, count=size)

    def read(self, path: str, size: int, role: str = "read") -> np.ndarray:
        """The first ``size`` bytes of the file ``path`` (no link followed),
        in this role's buffer; OSError when it is shorter."""
        return self.read_ranges(path, [(0, size)], role)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]], role: str = "read") -> np.ndarray:
        """The bytes of ``ranges`` (``(offset, length)`` pairs) of the file
        ``path`` (no link followed, a regular file), concatenated, in this
        role's buffer; OSError when the file ends before them."""
        total = sum(n for _, n in ranges)
        data = self.buffer(total, role)
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device); never read", path)
            end = max((o + n for o, n in ranges), default=0)
            if st.st_size < end:
                raise OSError(errno.EIO, f"{st.st_size} bytes, the checkpoint recorded at least {end}", path)
            pieces = [(o, n) for o, n in ranges if n]
            if pieces:
                views, at = [], 0
                for _, n in pieces:
                    views.append(data[at: at + n])
                    at += n
                self.session.engine.read([fd], [path], np.zeros(len(pieces), np.int64),
                                         np.array([o for o, _ in pieces], np.int64), views,
                                         coalesce_gap=self.options.coalesce_gap_bytes)
        finally:
            os.close(fd)
        return data

    def _open(self, path: str, flags: int) -> int:
        """``path`` opened beneath its directory (a real one, no link
        followed: :mod:`fp_dcp.files`), with O_DIRECT when the session uses
        it (buffered where the file system refuses it)."""
        directory, name = os.path.split(path)
        with store.opened(directory) as d:
            if self.session.direct:
                try:
                    return d.open_fd(name, flags | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
            return d.open_fd(name, flags)

    def write(self, path: str, data: np.ndarray, sync: bool, *, new: bool = False) -> None:
        """``data`` as the whole file ``path`` (created or truncated, or with
        ``new`` created only where nothing is; no link followed), synced
        when ``sync``."""
        fd = self._open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC))
        try:
            if len(data):
                self.session.write_fds([fd], [path], np.zeros(1, np.int64), np.zeros(1, np.int64), [data],
                                       sync=sync)
            if os.fstat(fd).st_size != len(data):  # O_DIRECT pads the last block to the alignment
                os.ftruncate(fd, len(data))
                if sync:
                    os.fsync(fd)
        finally:
            os.close(fd)

    def write_named(self, path: str, data: np.ndarray, sync: bool) -> None:
        """:meth:`write` under a new temporary name beside ``path``, renamed
        over it only when whole (and synced when ``sync``): a reader never
        takes a half-written file for a data file.  The temporary is removed
        on failure."""
        directory, name = os.path.split(path)
        tmp = f"{name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"
        try:
            self.write(os.path.join(directory, tmp), data, sync, new=True)
            with store.opened(directory) as d:
                d.rename(tmp, name)
        except BaseException:
            with store.opened(directory) as d:
                d.unlink(tmp)
            raise

    def close(self) -> None:
        self._buffers.clear()  # freed with their last view
        self.session.close()


def file_io_for(io: FileIO | None, options: FastPersistOptions, directory: str) -> FileIO:
    """``io`` when it serves ``directory``'s file system, else a new
    :class:`FileIO` for it (``io`` closed): a thread's reused copier."""
    if io is not None and io.matches(directory):
        return io
    if io is not None:
        io.close()
    return FileIO(options, directory)
