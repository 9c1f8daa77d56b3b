"""Shared reads on one rank: :class:`SharedReads` runs the rounds of a
:class:`~.plan.SharePlan` (reads the units this rank owns, hands their parts
to the ranks that need them) and returns the items left to read from disk."""

# Every rank runs the same collectives in the same order: per round one
# all-gather of a status (and, when a rank failed, of the errors), so a failed
# read raises on every rank in the same round instead of leaving the others
# waiting; then the point-to-point sends and receives of that round's parts.
# Round i's transfers are in flight while rounds i + 1 and i + 2 are read from
# disk (READ_AHEAD); a target is committed once all its parts have arrived.
#
# With the "auto" transport, a part whose owner is on the same machine
# (PeerMemory) is pulled: the status all-gather also carries the address of
# every box the owners read this round, and the rank that needs the part
# copies it from there with one process_vm_readv into its target.  The owner
# keeps that box untouched until the ranks that pull from it have: each keeps
# a counter of the rounds it has pulled, which the owner reads (8 bytes, the
# same way) before it reads another round into that box; one status more ends
# the load, so no rank frees a box before every rank has pulled from it.

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, TypeVar

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from fp_dcp.engine import IOSession
from fp_dcp.load.execute import Run
from fp_dcp.load.jobs import ItemPlanner, Job, storage_bytes
from fp_dcp.load.plan import box_runs
from fp_dcp.load.sharing.messages import gather_texts
from fp_dcp.load.sharing.plan import READ_AHEAD, Part, SharedUnit, SharePlan, read_key
from fp_dcp.load.sharing.transport import PeerMemory, Scratch, Transfer, post_transfers, takes_transfer, transfer_device

__all__ = ["SharedReads"]

_CPU = torch.device("cpu")
_T = TypeVar("_T")


class _Ring(Generic[_T]):
    """Buffers (or engines) the rounds take in turn: round ``i`` takes
    ``items[i % len(items)]``, so it reuses what round ``i - len(items)`` took."""

    def __init__(self, items: list[_T]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def of(self, round_index: int) -> _T:
        return self.items[round_index % len(self.items)]


@dataclasses.dataclass
class _RoundPlan:
    """What this rank knows of one round before it starts: per owner, its
    units with a pulled part (their addresses go out with the round's status,
    in this order); the bytes of the boxes this rank reads and of its parts
    it packs to send; the ranks that pull from this rank's boxes."""

    pull_units: list[list[int]]
    box_bytes: list[int]
    packed_bytes: list[int]
    pullers: set[int]


@dataclasses.dataclass
class _Box:
    """A unit this rank owns, read from disk into ``src`` (the box's shape)."""

    index: int
    unit: SharedUnit
    src: torch.Tensor
    dtype: torch.dtype


@dataclasses.dataclass
class _Incoming:
    """This rank's part ``part_index`` of another rank's box: its target
    ``views`` and the view that takes the part as it is (``direct``), if any."""

    index: int
    unit: SharedUnit
    part_index: int
    part: Part
    dtype: torch.dtype
    views: list[tuple[ReadItem, torch.Tensor]]
    direct: torch.Tensor | None
    pulled: bool


@dataclasses.dataclass
class _Arrival:
    """A part that has landed in ``buf``: copied into every target view that
    is not ``buf`` itself, then counted for the item ``key``."""

    key: tuple
    buf: torch.Tensor
    views: list[tuple[ReadItem, torch.Tensor]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Pull:
    """A part this rank copies out of its owner's memory."""

    index: int
    unit: SharedUnit
    part: Part
    arrival: _Arrival


@dataclasses.dataclass
class _Round:
    """One round on this rank: what it reads, sends, receives, finishes."""

    index: int
    error: BaseException | None = None
    jobs: list[Job] = dataclasses.field(default_factory=list)
    reads: list[_Box] = dataclasses.field(default_factory=list)
    sends: list[Transfer] = dataclasses.field(default_factory=list)
    receives: list[Transfer] = dataclasses.field(default_factory=list)
    finishes: list[_Arrival] = dataclasses.field(default_factory=list)
    pulls: list[_Pull] = dataclasses.field(default_factory=list)
    addresses: dict[int, int] = dataclasses.field(default_factory=dict)  # unit -> address of the box read
    works: list[Any] = dataclasses.field(default_factory=list)
    read_needed: int = 0
    my_bytes: int = 0


class SharedReads:
    """One rank's part in a load's shared reads.  ``run``: this rank's executor
    (None when setting it up failed: ``setup_error``, which the others learn in
    the first round); ``twin_session(i)``: the ``i``-th other engine pair.
    Call :meth:`run`; its ``shared_*`` stats join the reader's ``last_stats``."""

    def __init__(self, group: Any, share: SharePlan, run: Run | None,
                 twin_session: Callable[[int], tuple[IOSession, IOSession | None]],
                 items: ItemPlanner, planner: LoadPlanner, read_items: list[ReadItem],
                 setup_error: BaseException | None = None) -> None:
        import torch.distributed as dist

        started = time.perf_counter()
        self.group = group
        self.share = share
        self.items = items
        self.planner = planner
        self.read_items = read_items
        self.setup_error = setup_error
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = transfer_device(group)
        self.peers = PeerMemory(group, self.rank, self.world, self.device, share.transport == "auto")
        self.plans = [self._plan_round(r0, r1) for r0, r1 in share.rounds]
        self.pulling = any(any(p.pull_units) for p in self.plans)
        self.by_key: dict[tuple, list[ReadItem]] = {}
        for req in read_items:
            if req.type == LoadItemType.TENSOR:
                self.by_key.setdefault(read_key(req), []).append(req)
        # the parts each of this rank's items waits for, and one tag per part
        self.left: dict[tuple, int] = {}
        self.tag_base: list[int] = []
        ntags = 0
        for u in share.units:
            self.tag_base.append(ntags)
            ntags += len(u.parts)
            for p in u.parts:
                if p.rank == self.rank:
                    key = u.item_key(p)
                    self.left[key] = self.left.get(key, 0) + 1
        self.dests: dict[int, torch.Tensor] = {}
        self.runs = _Ring(self._runs(run, twin_session))
        self._make_buffers(4096 if run is None else run.alignment)
        self.faulting: dict[int, Any] = {}  # scratch -> its allocation ahead, by the prefault thread
        self.stats = {"shared_bytes_sent": 0, "shared_bytes_received": 0, "shared_bytes_read": 0,
                      "shared_bytes_pulled": 0, "shared_rounds": len(share.rounds), "shared_wait_seconds": 0.0,
                      "shared_pull_seconds": 0.0, "shared_read_wait_seconds": 0.0, "shared_status_seconds": 0.0,
                      "shared_split_seconds": 0.0, "shared_prepare_seconds": 0.0}
        self.pull_error: list[BaseException] = []  # a failed pull, raised on every rank at the next status
        self.stats["shared_setup_seconds"] = time.perf_counter() - started

    def _plan_round(self, r0: int, r1: int) -> _RoundPlan:
        plan = _RoundPlan([[] for _ in range(self.world)], [], [], set())
        for ui in range(r0, r1):
            u = self.share.units[ui]
            if any(self._pulled(u, p) for p in u.parts):
                plan.pull_units[u.owner].append(ui)
            if u.owner == self.rank:
                plan.pullers.update(p.rank for p in u.parts if self._pulled(u, p))
                esize = u.nbytes // max(1, math.prod(u.lengths))
                plan.box_bytes.append(u.nbytes)
                plan.packed_bytes += [math.prod(p.lengths) * esize for p in u.parts
                                      if p.rank != self.rank and not self._pulled(u, p)]
        return plan

    def _runs(self, run: Run | None,
              twin_session: Callable[[int], tuple[IOSession, IOSession | None]]) -> list[Run]:
        """The rounds read ahead, each by its own engine when a second one can be had
        (else one engine reads every round)."""
        runs: list[Run] = [] if run is None else [run]
        if run is not None and self.setup_error is None:
            while len(runs) < min(READ_AHEAD, len(self.share.rounds)):
                try:
                    runs.append(run.with_session(*twin_session(len(runs) - 1)))
                except (OSError, MemoryError, RuntimeError):
                    break
        return runs

    def _make_buffers(self, alignment: int) -> None:
        """The rings of a round's buffers (``READ_AHEAD + 1`` each, freed in time);
        a box peers pull from is reused once they have pulled it."""
        ring = READ_AHEAD + 1
        self.counted = all(self.peers.can_pull(self.rank, r) for plan in self.plans for r in plan.pullers)
        self.temps = _Ring([Scratch(_CPU, alignment) for _ in range(ring + (0 if self.counted else 1))])
        self.packs = _Ring([Scratch(self.device, alignment) for _ in range(ring)])
        # used only for targets that cannot take a receive / a pull as they are
        self.recvs = _Ring([Scratch(self.device, alignment, prefault=False) for _ in range(ring)])
        self.landings = _Ring([Scratch(_CPU, alignment, prefault=False) for _ in range(ring)])
        # each temporary and pack is allocated (and faulted in) once, for the
        # largest round, not again whenever a round is larger than the last
        self.peak_temp = max((self.temps.items[0].need(p.box_bytes) for p in self.plans), default=0)
        self.peak_pack = max((self.packs.items[0].need(p.packed_bytes) for p in self.plans), default=0)

    # ----------------------------------------------------------- targets

    def _pulled(self, u: SharedUnit, p: Part) -> bool:
        return p.rank != u.owner and self.peers.can_pull(p.rank, u.owner)

    def _dest_of(self, req: ReadItem, dtype: torch.dtype) -> torch.Tensor:
        d = self.dests.get(id(req))
        if d is None:
            d = self.dests[id(req)] = self.items.target(req, self.planner, dtype)
        return d

    def _views(self, u: SharedUnit, p: Part, dtype: torch.dtype) -> list[tuple[ReadItem, torch.Tensor]]:
        """This rank's targets of part ``p``: (read item, view of its target)."""
        reqs = self.by_key.get(u.item_key(p))
        if not reqs:
            raise RuntimeError(f"{u.fqn}: the shared-read plan names a read this rank does not have "
                               f"(box {list(p.item_offsets)}+{list(p.item_lengths)})")
        rel = tuple(slice(o - io, o - io + n) for o, io, n in zip(p.offsets, p.item_offsets, p.lengths))
        return [(req, self._dest_of(req, dtype)[rel]) for req in reqs]

    def _arrived(self, arrival: _Arrival) -> None:
        """Copy an arrived part into its other views; commit each target
        once all its parts have arrived."""
        for _, v in arrival.views:
            if v is not arrival.buf:
                v.copy_(arrival.buf)
        key = arrival.key
        self.left[key] -= 1
        if self.left[key] == 0:
            for req in self.by_key[key]:
                self.planner.commit_tensor(req, self.dests[id(req)])

    # ----------------------------------------------------------- one round

    def _prepare(self, ri: int) -> _Round:
        """Resolve the round's targets, choose its buffers, plan its reads
        (main thread; errors are kept for the round's agreement)."""
        rd = _Round(ri)
        try:
            if self.setup_error is not None:
                raise self.setup_error
            temp, pack = self.temps.of(ri), self.packs.of(ri)
            recv, landing = self.recvs.of(ri), self.landings.of(ri)
            before = ri - len(self.temps)  # the round that last read into ``temp``
            if self.counted and before >= 0:
                self.peers.wait_pulled(self.plans[before].pullers, before)
            for sc in (temp, pack):
                fut = self.faulting.pop(id(sc), None)
                if fut is not None:  # allocated ahead by the prefault thread
                    fut.result()
            for sc in (temp, pack, recv, landing):
                sc.reset()
            if self.plans[ri].box_bytes:
                temp.reserve(self.peak_temp)
            if self.plans[ri].packed_bytes:
                pack.reserve(self.peak_pack)
            incoming = self._plan_reads(rd, temp)
            for sc, by_pull in ((recv, False), (landing, True)):
                sc.reserve(sc.need([math.prod(x.part.lengths) * x.dtype.itemsize
                                    for x in incoming if x.direct is None and x.pulled == by_pull]))
            for x in incoming:
                buf = x.direct
                if buf is None:
                    buf = (landing if x.pulled else recv).take(x.part.lengths, x.dtype)
                rd.my_bytes += buf.numel() * buf.element_size()
                arrival = _Arrival(x.unit.item_key(x.part), buf, x.views)
                if x.pulled:
                    rd.pulls.append(_Pull(x.index, x.unit, x.part, arrival))
                else:
                    rd.receives.append(Transfer(buf, x.unit.owner, self.tag_base[x.index] + x.part_index))
                    rd.finishes.append(arrival)
        except BaseException as e:  # noqa: BLE001 - agreed on below
            rd.error = e
        return rd

    def _plan_reads(self, rd: _Round, temp: Scratch) -> list[_Incoming]:
        """Plan the disk reads of the boxes this rank owns in round ``rd``
        (into ``rd``); return its parts of others' boxes."""
        rank, share = self.rank, self.share
        run = self.runs.of(rd.index)
        r0, r1 = share.rounds[rd.index]
        incoming = []
        for ui in range(r0, r1):
            u = share.units[ui]
            chunk = None if u.chunk is None else list(u.chunk)
            sizes, dtype = self.items.chunk_sizes(u.fqn, chunk)
            if u.owner == rank:
                src = None
                for p in u.parts:  # a target that is the whole box takes the read itself
                    if p.rank == rank and p.offsets == u.offsets and p.lengths == u.lengths:
                        src = next((v for _, v in self._views(u, p, dtype) if takes_transfer(v, dtype, _CPU)),
                                   None)
                        if src is not None:
                            break
                if src is None:
                    src = temp.take(u.lengths, dtype)
                rd.jobs.extend(self.items.plan_box(u.fqn, chunk, sizes, dtype, list(u.offsets),
                                                   list(u.lengths), src, run.limits, lambda: None))
                rd.reads.append(_Box(ui, u, src, dtype))
                rd.addresses[ui] = src.data_ptr()  # contiguous, the box's shape
                continue
            for pi, p in enumerate(u.parts):
                if p.rank == rank:
                    vs = self._views(u, p, dtype)
                    pulled = self._pulled(u, p)
                    on = _CPU if pulled else self.device
                    direct = next((v for _, v in vs if takes_transfer(v, dtype, on)), None)
                    incoming.append(_Incoming(ui, u, pi, p, dtype, vs, direct, pulled))
        return incoming

    def _read(self, rd: _Round) -> None:
        """The round's disk reads (a background thread: it sees only the
        round's jobs and its ``Run``, which nothing else touches meanwhile)."""
        if rd.error is not None or not rd.jobs:
            return
        run = self.runs.of(rd.index)
        before = run.stats["bytes"]
        run.execute(rd.jobs)
        rd.read_needed = run.stats["bytes"] - before

    def _split(self, rd: _Round) -> None:
        """Owner: copy its own parts into its targets, pack the others'."""
        if rd.error is not None:
            return
        pack = self.packs.of(rd.index)
        stats = self.stats
        try:
            for box in rd.reads:
                ui, u, src, dtype = box.index, box.unit, box.src, box.dtype
                stats["shared_bytes_read"] += u.nbytes
                for pi, p in enumerate(u.parts):
                    rel = tuple(slice(o - uo, o - uo + n) for o, uo, n in zip(p.offsets, u.offsets, p.lengths))
                    part = src[rel]
                    if p.rank == self.rank:
                        for _, v in self._views(u, p, dtype):
                            if v.data_ptr() != part.data_ptr() or v.stride() != part.stride():
                                v.copy_(part)
                        rd.finishes.append(_Arrival(u.item_key(p), part))  # copied above
                        rd.my_bytes += part.numel() * part.element_size()
                    elif self._pulled(u, p):  # the rank copies it from ``src`` itself
                        stats["shared_bytes_sent"] += part.numel() * part.element_size()
                    elif takes_transfer(part, dtype, self.device):
                        # a target, or this round's temporary: neither is
                        # written again before the send has completed
                        rd.sends.append(Transfer(part, p.rank, self.tag_base[ui] + pi))
                    else:
                        buf = pack.take(p.lengths, dtype)
                        buf.copy_(part)
                        rd.sends.append(Transfer(buf, p.rank, self.tag_base[ui] + pi))
        except BaseException as e:  # noqa: BLE001
            rd.error = e

    def _agree(self, rd: _Round) -> dict[int, int]:
        """Every rank learns whether any rank failed this round; all raise.
        Returns the addresses of the boxes read this round that have pulled
        parts (unit -> address in its owner)."""
        import torch.distributed as dist

        world, rank = self.world, self.rank
        if self.pull_error and rd.error is None:
            rd.error = self.pull_error[0]
        error = None if rd.error is None else f"{type(rd.error).__name__}: {rd.error}"
        per = self.plans[rd.index].pull_units if rd.index < len(self.plans) else [[] for _ in range(world)]
        width = 1 + max(len(x) for x in per)
        status = torch.zeros(width, dtype=torch.int64)
        status[0] = 0 if error is None else 1
        if error is None:
            for j, ui in enumerate(per[rank]):
                status[1 + j] = rd.addresses[ui]
        status = status.to(self.device)
        statuses = [torch.empty_like(status) for _ in range(world)]
        dist.all_gather(statuses, status, group=self.group)
        gathered = torch.stack(statuses).cpu()
        if gathered[:, 0].any():
            errors = gather_texts(error, self.group, world, self.device)  # plain bytes, no pickle
            failed = {r: e or "failed without saying why" for r, e in enumerate(errors) if e or gathered[r, 0]}
            first = min(failed)
            raise RuntimeError(
                f"shared read failed on rank {first}: {failed[first]}"
                + ("" if first == rank else " (this rank stopped because of it)")
            )
        return {ui: int(gathered[r, 1 + j]) for r in range(world) for j, ui in enumerate(per[r])}

    def _pull(self, rd: _Round, addresses: dict[int, int]) -> None:
        """Copy this rank's pulled parts of the round out of their owners'
        memory and finish them; a failure is raised at the next status."""
        if self.pull_error or not rd.pulls:
            return
        t = time.perf_counter()
        try:
            for pull in rd.pulls:
                u, p, buf = pull.unit, pull.part, pull.arrival.buf
                esize = buf.element_size()
                rel = [o - uo for o, uo in zip(p.offsets, u.offsets)]
                starts, run_length = box_runs(u.lengths, rel, p.lengths, esize)
                self.peers.pull(u.owner, storage_bytes(buf), addresses[pull.index], starts, run_length)
                self.stats["shared_bytes_pulled"] += buf.numel() * esize
                self.stats["shared_bytes_received"] += buf.numel() * esize
                self._arrived(pull.arrival)
        except BaseException as e:  # noqa: BLE001 - agreed on at the next status
            self.pull_error.append(self.peers.failed(f"{u.fqn}: copying a shared part", u.owner, e))
        self.stats["shared_pull_seconds"] += time.perf_counter() - t

    def _post(self, rd: _Round) -> None:
        for t in rd.sends:
            self.stats["shared_bytes_sent"] += t.buf.numel() * t.buf.element_size()
        for t in rd.receives:
            self.stats["shared_bytes_received"] += t.buf.numel() * t.buf.element_size()
        rd.works.extend(post_transfers(rd.sends, rd.receives, self.group, self.device))

    def _complete(self, rd: _Round) -> None:
        t = time.perf_counter()
        for w in rd.works:
            w.wait()
        self.stats["shared_wait_seconds"] += time.perf_counter() - t
        for arrival in rd.finishes:
            self._arrived(arrival)

    # ----------------------------------------------------------- the rounds

    def run(self) -> list[ReadItem]:
        """Run every round; the read items still to read from disk."""
        # Rounds i + 1 .. i + READ_AHEAD are read from disk by helper threads
        # (the engines release the GIL; one engine each, see ``runs``) while this
        # thread splits round i, posts its transfers and pulls its parts, and
        # gloo's threads move round i - 1.
        # The buffers cycle through rings: see ``_make_buffers``.
        n = len(self.share.rounds)
        runs, temps, packs, plans = self.runs.items, self.temps, self.packs, self.plans
        progress = self.peers.progress
        pending: _Round | None = None  # posted, not completed
        reading: deque = deque()  # (round, future), in order
        read_needed = my_bytes = 0
        # Memory a process touches for the first time is slow to fault in (on
        # VMs whose host hands out a page only when the guest first writes it).
        # The temporaries and packs are faulted in by a thread of their own, in
        # the order the rounds take them, while the first rounds are read, not
        # by this thread when a round needs one.
        prefault = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp_dcp-prefault")
        if self.setup_error is None:
            for ri in range(n):
                for sc, nbytes in ((temps.of(ri), self.peak_temp if plans[ri].box_bytes else 0),
                                   (packs.of(ri), self.peak_pack if plans[ri].packed_bytes else 0)):
                    if nbytes and id(sc) not in self.faulting:
                        self.faulting[id(sc)] = prefault.submit(sc.reserve, nbytes)
        with prefault, ThreadPoolExecutor(max_workers=max(1, len(runs)),
                                          thread_name_prefix="fp_dcp-shared-read") as pool:
            try:
                for ri in range(min(n, READ_AHEAD)):
                    rd = self._prepare(ri)
                    reading.append((rd, pool.submit(self._read, rd)))
                clock = time.perf_counter
                stats = self.stats
                for ri in range(n):
                    rd, fut = reading.popleft()
                    t = clock()
                    try:
                        fut.result()
                    except BaseException as e:  # noqa: BLE001
                        rd.error = rd.error or e
                    stats["shared_read_wait_seconds"] += clock() - t
                    if pending is not None:  # frees the buffers round ri + READ_AHEAD takes
                        done, pending = pending, None
                        self._complete(done)
                    if ri + READ_AHEAD < n:
                        t = clock()
                        nxt = self._prepare(ri + READ_AHEAD)
                        reading.append((nxt, pool.submit(self._read, nxt)))
                        stats["shared_prepare_seconds"] += clock() - t
                    t = clock()
                    self._split(rd)
                    stats["shared_split_seconds"] += clock() - t
                    t = clock()
                    addresses = self._agree(rd)
                    stats["shared_status_seconds"] += clock() - t
                    read_needed += rd.read_needed
                    my_bytes += rd.my_bytes
                    self._post(rd)
                    self._pull(rd, addresses)
                    progress[0] = rd.index + 1  # its owners may reuse the round's boxes
                    pending = rd
                if self.pulling:  # no rank frees a box before every rank has pulled from it
                    self._agree(_Round(n))
            finally:
                progress[0] = n + 1  # pulls no more (also when it leaves early): no owner waits for it
                for fut in self.faulting.values():  # not started: not needed any more
                    fut.cancel()
                for _, fut in reading:  # a failed round: let the next reads end before their buffers go
                    try:
                        fut.result()
                    except BaseException:  # noqa: BLE001
                        pass
                if pending is not None:  # matched on every rank: completes also when a later round failed
                    self._complete(pending)
                for extra in runs[1:]:
                    extra.close()  # its session stays with the reader, as the first
        run = runs[0]
        for extra in runs[1:]:
            for k, v in extra.stats.items():
                if isinstance(v, (int, float)):  # some keys appear only once a run has read
                    run.stats[k] = run.stats.get(k, 0) + v
        self.stats["shared_buffer_bytes"] = sum(sc.size for ring in (temps, packs, self.recvs, self.landings)
                                                for sc in ring.items)
        run.stats.update(self.stats)
        # "bytes" counts what this rank's targets need, not the boxes it read for others
        run.stats["bytes"] += my_bytes - read_needed
        covered = set(self.left)
        return [r for r in self.read_items if read_key(r) not in covered]
