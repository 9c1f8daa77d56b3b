"""A restore's replica copies: the extents a node needs of a file, read by a
holder on another node and sent in parts, each checked on arrival and written
at its offsets; reading, sending and writing overlap (docs/TIERS.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable

import numpy as np

from fp_dcp import format as fmt
from fp_dcp.tiers import integrity, store
from fp_dcp.tiers.integrity import ranges_bytes
from fp_dcp.tiers.plan import Failure, Need, Pick
from fp_dcp.tiers.replicate import FileIO, Transfer, run_transfers

__all__ = ["ReplicaMoves", "ReadAhead"]


@dataclasses.dataclass(frozen=True)
class _Part:
    """Part ``k`` of a need's ranges (``last``: the final one)."""

    need: Need
    ranges: list[tuple[int, int]]
    k: int
    last: bool


@dataclasses.dataclass(frozen=True)
class _PartFailure:
    part: int
    sender: int
    why: str


class ReplicaMoves:
    """One round's replica copies on this rank: build with the plan (every rank
    alike), :meth:`run` once.  ``taken``: the bytes received whole and good."""

    def __init__(self, plan: list[Pick], *, rank: int, layout: fmt.StorageLayout, local_dir: str,
                 receiving: dict[str, store.RangesFile], file_io: Callable[[], FileIO], chunk_bytes: int,
                 source_of: Callable[[int], str], hook: Callable[[str], None]) -> None:
        self.rank, self.layout, self.receiving, self.local_dir = rank, layout, receiving, local_dir
        self.fid_of = {n: i for i, (n, _) in enumerate(layout.files)}
        self.source_of, self.hook = source_of, hook
        self.parts: dict[tuple[int, str], _Part] = {}  # (receiver, transfer name) -> part
        self.transfers: list[Transfer] = []
        for pick in plan:
            if pick.tier != "replica":
                continue
            split = integrity.split_ranges(layout, self.fid_of[pick.need.name], pick.need.ranges, chunk_bytes)
            for k, ranges in enumerate(split):
                t = Transfer(pick.src, pick.need.receiver, f"{pick.need.name}:{k}", ranges_bytes(ranges))
                self.parts[(t.dst, t.name)] = _Part(pick.need, ranges, k, k == len(split) - 1)
                self.transfers.append(t)
        self.sends = [t for t in self.transfers if t.src == rank != t.dst]
        self.receives = [t for t in self.transfers if t.dst == rank != t.src]
        self.arrived: dict[str, int] = {}  # parts received good, by file
        self.failures: dict[str, _PartFailure] = {}  # file -> its first failed part
        self.taken = 0
        self._file_io = file_io
        self._turn = 0
        self._buffers: list[np.ndarray] = []
        self._jobs: list[concurrent.futures.Future | None] = [None, None]
        self._ahead: ReadAhead | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, group) -> list[Failure]:
        """This rank's part of the round over ``group``; its failed copies."""
        if not self.sends and not self.receives:
            return []
        self._ahead = ReadAhead(self._file_io() if self.sends else None,
                                [(self.parts[(t.dst, t.name)].need.name, self.parts[(t.dst, t.name)].ranges)
                                 for t in self.sends], self.local_dir)
        size = max((t.size for t in self.receives), default=0)
        self._buffers = [np.empty(size, dtype=np.uint8) for _ in range(2)]
        self._writer = writer = \
            concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-write") if self.receives else None
        try:
            _, failed = run_transfers(self.transfers, self.rank, group, self._read, self._receive,
                                      receive_buffer=self._receive_buffer)
            if writer is not None:
                writer.shutdown(wait=True)  # every part received is checked and written
            for t, why in failed.items():  # a part its sender could not read
                if t.dst == self.rank:
                    part = self.parts[(t.dst, t.name)]
                    seen = self.failures.get(part.need.name)
                    if seen is None or seen.part > part.k:
                        self.failures[part.need.name] = _PartFailure(part.k, t.src, why)
        finally:
            if writer is not None:
                writer.shutdown(wait=True)
            self._ahead.close()
            for f in self.receiving.values():  # not whole, or not good: removed, never read
                f.discard()
            self.receiving.clear()
        return [Failure(name, self.source_of(f.sender), f.why, self.rank)
                for name, f in sorted(self.failures.items())]

    def _read(self, t: Transfer) -> Any:
        assert self._ahead is not None
        data = self._ahead.take()
        self.hook(f"send {self.parts[(t.dst, t.name)].need.name}")
        return data.result()

    def _receive_buffer(self, t: Transfer) -> np.ndarray:
        slot = self._turn % 2
        job = self._jobs[slot]
        if job is not None:
            job.result()  # the part received into it two parts ago is written
        return self._buffers[slot][: t.size]

    def _receive(self, t: Transfer, data: Any) -> None:
        slot = self._turn % 2
        self._turn += 1
        assert self._writer is not None
        self._jobs[slot] = self._writer.submit(self._check_and_write, t, data)

    def _check_and_write(self, t: Transfer, data: Any) -> None:
        part = self.parts[(t.dst, t.name)]
        name = part.need.name
        if name in self.failures:  # an earlier part failed: the file comes from the next source
            return
        if self.arrived.get(name, 0) != part.k:  # an earlier part never came (its sender failed)
            self.failures[name] = _PartFailure(part.k, t.src, f"part {self.arrived.get(name, 0)} did not arrive")
            return
        try:
            integrity.check_buffer(data, self.layout, self.fid_of[name], f"{name} from rank {t.src}",
                                   ranges=part.ranges)
            self.receiving[name].write(part.ranges, data)
        except Exception as e:  # noqa: BLE001 - this copy fails; the file comes from the next source
            self.failures[name] = _PartFailure(part.k, t.src, str(e))
            return
        self.arrived[name] = part.k + 1
        if part.last:
            self.receiving.pop(name).close()
            self.taken += ranges_bytes(part.need.ranges)


class ReadAhead:
    """The parts a rank sends, in the order it sends them, each read while
    the one before is sent: on a thread of its own, with O_DIRECT
    (:meth:`FileIO.read_ranges`), into two buffers used in turn, so a
    part's bytes stay valid until the part after it is taken."""

    def __init__(self, io: FileIO | None, parts: list[tuple[str, list[tuple[int, int]]]], directory: str) -> None:
        self.io, self.parts, self.directory, self.next = io, parts, directory, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-read") if parts else None
        self.pending = self._start(0)

    def _start(self, k: int) -> concurrent.futures.Future | None:
        if k >= len(self.parts):
            return None
        assert self.pool is not None and self.io is not None
        name, ranges = self.parts[k]
        return self.pool.submit(self.io.read_ranges, os.path.join(self.directory, name), ranges, f"send{k % 2}")

    def take(self) -> concurrent.futures.Future:
        """The next part's read (its bytes: ``.result()``); starts reading
        the one after it."""
        fut = self.pending
        assert fut is not None, "more parts taken than listed"
        self.next += 1
        self.pending = self._start(self.next)
        return fut

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
