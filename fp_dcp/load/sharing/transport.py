"""How the parts of shared reads move between ranks, and the memory they
move through: :func:`post_transfers` (the process group's sends and
receives), :class:`PeerMemory` (copies straight out of a same-machine peer's
memory), :class:`Scratch` (a round's reusable temporaries)."""

from __future__ import annotations

import math
import os
import secrets
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from fp_dcp import _native

__all__ = ["machine_key", "machine_id", "transfer_device", "takes_transfer", "Scratch", "PeerMemory",
           "Transfer", "post_transfers"]

_ZERO_START = np.zeros(1, dtype=np.int64)  # one run, from the address given
# While an owner waits for a puller's progress counter: short, as the puller
# is copying a round the owner has already passed.
_PULL_POLL_SECONDS = 0.0002


def machine_key() -> tuple:
    """Equal for two processes that may be able to read each other's memory:
    the same host name and boot, the same pid namespace."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return (socket.gethostname(), os.getpid())  # unknown: only itself
    return (socket.gethostname(), boot, pidns)


def machine_id() -> int:
    """:func:`machine_key` as a signed 64-bit hash."""
    import hashlib

    digest = hashlib.blake2b(repr(machine_key()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def transfer_device(group: Any) -> torch.device:
    """Where the group's point-to-point buffers must live: CUDA for NCCL, the
    CPU for gloo (also a "cpu:gloo,cuda:nccl" group) and others."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def takes_transfer(view: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """``view`` can be sent or received into as it is."""
    return (view.device == device and view.dtype == dtype and view.is_contiguous()
            and not view.is_conj() and not view.is_neg())


class Scratch:
    """Reusable memory for one round's temporaries: ``take`` hands out
    tensors back to back (aligned, on ``device``), ``reset`` starts over.
    CPU memory comes from an aligned buffer, so the engine reads into it
    without a bounce copy, and is faulted in once per load."""

    def __init__(self, device: torch.device, alignment: int, prefault: bool = True) -> None:
        self.device, self.alignment, self.prefault = device, max(64, alignment), prefault
        self.raw: Any = None
        self.base: torch.Tensor | None = None
        self.used = 0

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (call before ``take``, after ``reset``)."""
        if nbytes <= self.size:
            return
        size = -(-nbytes // self.alignment) * self.alignment
        if self.device.type == "cpu":
            self.raw = _native.AlignedBuffer(size, max(self.alignment, 4096), lock=False, prefault=self.prefault)
            self.base = torch.frombuffer(self.raw, dtype=torch.uint8)
        else:
            self.base = torch.empty(size, dtype=torch.uint8, device=self.device)

    def reset(self) -> None:
        self.used = 0

    @property
    def size(self) -> int:
        return 0 if self.base is None else self.base.numel()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // self.alignment) * self.alignment
        if self.base is None or start + nbytes > self.base.numel():
            return torch.empty(list(shape), dtype=dtype, device=self.device)  # a plan that under-reserved
        self.used = start + nbytes
        return self.base[start : start + nbytes].view(dtype).view(list(shape))

    def need(self, sizes: list[int]) -> int:
        a = self.alignment
        return sum(-(-n // a) * a for n in sizes)


class PeerMemory:
    """Which ranks can copy from which ranks' memory (probed with ``probe``, the
    ``"auto"`` transport), and the copies; ``progress[0]``: the rounds this rank
    has pulled its parts of."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device, probe: bool) -> None:
        self.world = world
        self.progress = np.zeros(1, dtype=np.int64)
        self.table: list[frozenset[int]] = [frozenset()] * world
        self.pids: list[int] = []
        self.progress_at: list[int] = []
        if probe and world > 1:
            self._probe(group, rank, device)

    def can_pull(self, rank: int, owner: int) -> bool:
        """Whether ``rank`` can copy from ``owner``'s memory."""
        return owner in self.table[rank]

    def _probe(self, group: Any, rank: int, device: torch.device) -> None:
        """Fill ``table[r]`` (the ranks whose memory rank ``r`` can copy from),
        ``pids`` and ``progress_at`` (each rank's progress counter); every
        rank learns the whole table (two all-gathers)."""
        # Each rank shows a random token in its memory; every other rank of the
        # same machine key pulls it and keeps the peer only when the token came
        # back, so a refused call (ptrace rules, seccomp), another pid namespace
        # or a reused pid is never trusted.
        import torch.distributed as dist

        world = self.world
        token = np.frombuffer(secrets.token_bytes(16), dtype=np.int64).copy()
        key = machine_id()
        mine = torch.tensor([key, os.getpid(), int(token.ctypes.data), int(token[0]), int(token[1]),
                             int(self.progress.ctypes.data)], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group)
        peers = torch.stack(rows).cpu().numpy()
        reachable = torch.zeros(world, dtype=torch.int64)
        got = np.zeros(2, dtype=np.int64)
        for r in range(world):
            if r == rank or peers[r, 0] != key:
                continue
            got[:] = 0
            try:
                _native.pull(int(peers[r, 1]), got.view(np.uint8), int(peers[r, 2]), _ZERO_START, 16)
            except OSError:
                continue
            if got[0] == peers[r, 3] and got[1] == peers[r, 4]:
                reachable[r] = 1
        table = [torch.empty_like(reachable, device=device) for _ in range(world)]
        dist.all_gather(table, reachable.to(device), group=group)  # also: no rank's token is pulled after this
        seen = torch.stack(table).cpu().numpy()
        self.table = [frozenset(np.flatnonzero(row).tolist()) for row in seen]
        self.pids = peers[:, 1].tolist()
        self.progress_at = peers[:, 5].tolist()

    def failed(self, what: str, owner: int, e: BaseException) -> RuntimeError:
        return RuntimeError(f"{what} from rank {owner}'s memory (pid {self.pids[owner]}) failed: {e}; set "
                            "shared_read_transport='process_group' to send parts instead")

    def pull(self, owner: int, dst: np.ndarray, address: int, starts: np.ndarray, run_length: int) -> None:
        """Copy the runs ``address + starts[i]`` of ``run_length`` bytes of
        ``owner``'s memory back to back into ``dst``."""
        _native.pull(self.pids[owner], dst, address, starts, run_length)

    def wait_pulled(self, pullers: set[int], round_index: int) -> None:
        """Until every rank of ``pullers`` shows a progress counter past
        ``round_index``."""
        cell = np.zeros(1, dtype=np.int64)
        for r in sorted(pullers):
            while True:
                try:
                    _native.pull(self.pids[r], cell.view(np.uint8), self.progress_at[r], _ZERO_START, 8)
                except OSError as e:
                    raise self.failed("reading the progress counter", r, e) from e
                if cell[0] > round_index:
                    break
                time.sleep(_PULL_POLL_SECONDS)


class Transfer(NamedTuple):
    """One point-to-point send or receive: ``buf`` to or from ``peer``."""

    buf: torch.Tensor
    peer: int
    tag: int


def post_transfers(sends: list[Transfer], receives: list[Transfer], group: Any, device: torch.device) -> list[Any]:
    """Post a round's sends and receives over the process group; their works."""
    import torch.distributed as dist

    works: list[Any] = []
    if device.type == "cuda":
        # NCCL runs a pair's sends and receives in order on one stream: a
        # send waits for its receive, so two ranks that both send first
        # would wait on each other.  One group call posts them together.
        ops = [dist.P2POp(dist.isend, t.buf, group=group, group_peer=t.peer, tag=t.tag % (1 << 30))
               for t in sends]
        ops += [dist.P2POp(dist.irecv, t.buf, group=group, group_peer=t.peer, tag=t.tag % (1 << 30))
                for t in receives]
        if ops:
            works.extend(dist.batch_isend_irecv(ops))
        return works
    for t in sends:
        works.append(dist.isend(t.buf, group=group, group_dst=t.peer, tag=t.tag % (1 << 30)))
    for t in receives:
        works.append(dist.irecv(t.buf, group=group, group_src=t.peer, tag=t.tag % (1 << 30)))
    return works
