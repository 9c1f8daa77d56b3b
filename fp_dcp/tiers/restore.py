"""Restoring from the fastest complete tier, on any world size (docs/TIERS.md,
**Restore**).  Each phase ends with an exchange of every rank's outcome, so
a failure anywhere is a :class:`TierRestoreError` on every rank."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
import zlib
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fp_dcp import FastPersistOptions, FastPersistReader, wire
from fp_dcp import format as fmt
from fp_dcp.tiers import integrity, store
from fp_dcp.tiers import plan as tplan
from fp_dcp.tiers.agree import TierError, exchange, share
from fp_dcp.tiers.integrity import ranges_bytes
from fp_dcp.tiers.moves import ReplicaMoves
from fp_dcp.tiers.plan import TIERS, Candidate, Failure, Inventory, Need, Pick, Source, subset_layout
from fp_dcp.tiers.replicate import FileIO
from fp_dcp.tiers.topology import Topology

__all__ = ["RestoreResult", "restore", "TierRestoreError", "subset_layout"]

#: The most bytes of a replica sent as one part (each part checked on
#: arrival): the holder reads the next part while this one crosses, the
#: receiver checks and writes it while the next arrives.
CHUNK_BYTES = 32 << 20

#: Tests: called with ``"local NAME"``, ``"send NAME"`` or ``"persistent
#: NAME"`` on the rank about to read that copy of data file NAME.
fault_hook: Callable[[str], None] | None = None


def _hook(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


class TierRestoreError(TierError):
    """No step is loadable from the tiers, or a rank failed during a restore
    (the message names it, the file and the error)."""


# every phase of a restore ends with every rank's outcome (fp_dcp.tiers.agree)
_exchange = functools.partial(exchange, error=TierRestoreError)


def _failures(group, world: int, what: str, work: Callable[[], list[Failure]]) -> list[Failure]:
    """Every rank's failed copies of a phase (the same sorted list on every rank)."""
    rows = _exchange(group, world, what, lambda: tplan.failures_to_wire(work()), spec=tplan.FAILURES_SPEC)
    return sorted({f for r in rows for f in tplan.failures_from_wire(r)})


@dataclasses.dataclass
class RestoreResult:
    step: int
    save_id: str
    bytes_from: dict[str, int]  # this rank's bytes taken from each tier (local, replica, persistent)
    skipped: list[str]  # every rank's: file, source and why it was passed over; steps passed over and why
    seconds: float
    node_bytes_from: dict[str, int] = dataclasses.field(default_factory=dict)  # the whole job's
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds: agree, plan, assemble, load
    #: the whole job's copies loaded: (node, data file, tier, bytes of it the node took)
    sources: list[Source] = dataclasses.field(default_factory=list)


class _Unloadable(Exception):
    """No tier holds a good copy of something this step needs (every rank
    raises it alike, from gathered facts)."""


@dataclasses.dataclass
class RestoreContext:
    """What every step's restore attempt on this rank works with."""

    state_dict: dict
    rank: int
    world: int
    topology: Topology
    local_root: str
    persistent_root: str | None
    group: Any  # the restore's own collectives and dcp.load
    moving: Any  # the replica transfers' collectives (a gloo group the restore made)
    bytes_group: Any  # the replicas' bytes (``moving``, or an NCCL group)
    planner: Any
    options: FastPersistOptions | None
    inventory: Inventory


def _inventory(group, world: int, rank: int, local_root: str, persistent_root: str | None) -> Inventory:
    def scan() -> list:
        pers: dict[int, store.Holding] = {}
        if rank == 0 and persistent_root is not None:
            pers = {s: h for s, h in store.scan(persistent_root).items() if h.save_id is not None}
        return [tplan.holdings_to_wire(store.scan(local_root)), tplan.holdings_to_wire(pers)]

    spec = (tplan.HOLDINGS_SPEC, tplan.HOLDINGS_SPEC)
    gathered = _exchange(group, world, "restore: taking stock of the tiers", scan, spec=spec)
    _, persistent = gathered[0]
    return Inventory([tplan.holdings_from_wire(local) for local, _ in gathered], tplan.holdings_from_wire(persistent))


def restore(state_dict: dict, *, rank: int, topology: Topology, local_root: str, persistent_root: str | None,
            group, bytes_group=None, planner=None, step: int | None = None,
            options: FastPersistOptions | None = None, timeout: timedelta | None = None) -> RestoreResult | None:
    """``group``: gloo group of every rank for the restore and ``dcp.load``;
    ``bytes_group``: the group replicas move over (NCCL, or ``None``: gloo);
    ``timeout``: of the gloo group made for the transfers."""
    t0 = time.perf_counter()
    world = dist.get_world_size(group)
    # the transfers' gloo group, made while the tiers are scanned, on a
    # thread started here: its threads (gloo's, which move the bytes) run at
    # the caller's priority, not the manager's background one
    pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-group")
    group_kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    making = pool.submit(dist.new_group, backend="gloo", **group_kwargs)
    pool.shutdown(wait=False)
    try:
        inv = _inventory(group, world, rank, local_root, persistent_root)
        moving = making.result()
        ctx = RestoreContext(state_dict, rank, world, topology, local_root, persistent_root, group, moving,
                             moving if bytes_group is None or bytes_group is group else bytes_group,
                             planner, options, inv)
        passed: list[str] = []  # steps passed over, and why
        excluded: set[int] = set()
        while True:
            chosen = tplan.choose(step, inv, excluded)
            if chosen is None:
                if passed:
                    raise TierRestoreError("no step is loadable from the tiers: " + "; ".join(passed))
                if step is not None:
                    raise TierRestoreError(f"step {step} is complete in no tier (local, replicas, persistent)")
                return None
            attempt = _StepRestore(ctx, chosen)
            attempt.phases["agree"] = time.perf_counter() - t0
            try:
                result = attempt.run()
            except _Unloadable as e:
                passed.append(f"step {chosen.step}: {e}")
                excluded.add(chosen.step)
                if step is not None:
                    raise TierRestoreError(f"step {chosen.step} is not loadable: {e}") from None
                continue
            result.skipped = [f"passed over {p}" for p in passed] + result.skipped
            result.seconds = time.perf_counter() - t0
            return result
    finally:
        dist.destroy_process_group(making.result())


class _StepRestore:
    """One attempt at restoring one step (phases 3 to 5)."""

    def __init__(self, ctx: RestoreContext, chosen: Candidate) -> None:
        self.ctx, self.chosen_step = ctx, chosen
        self.s, self.save_id, self.sizes = chosen.step, chosen.save_id, chosen.sizes
        self.rank, self.world, self.topology, self.group = ctx.rank, ctx.world, ctx.topology, ctx.group
        self.node = ctx.topology.node_of(ctx.rank)
        self.leader = ctx.topology.leader(self.node) == ctx.rank
        self.restore_dir = os.path.join(ctx.local_root, store.RESTORE_DIR)
        self.local_dir = store.step_dir(ctx.local_root, self.s)
        self.pers_dir = None if ctx.persistent_root is None else store.step_dir(ctx.persistent_root, self.s)
        self.phases: dict[str, float] = {}
        self.bad: set[tuple[str, str]] = set()  # (file, source)
        self.skipped: list[str] = []
        self.tried: dict[str, list[str]] = {}  # file -> "source: why" of every copy passed over
        self.taken = {t: 0 for t in TIERS}  # this rank's, of the copies in use
        self.chosen: dict[tuple[int, str], str] = {}  # (node, file) -> tier of the copy in use (every rank knows)
        self.receiving: dict[str, store.RangesFile] = {}  # the replica copies this rank receives this round
        self._io: FileIO | None = None

    # ------------------------------------------------------------ phases

    def run(self) -> RestoreResult:
        self._fresh_dir()
        try:
            return self._run()
        finally:
            for f in self.receiving.values():  # left by a failure
                f.discard()
            if self._io is not None:
                self._io.close()
            if self.leader:
                store.remove_owned(self.ctx.local_root, None, store.RESTORE_DIR)

    def _run(self) -> RestoreResult:
        t = time.perf_counter()
        self._metadata()
        load_planner = self.ctx.planner if self.ctx.planner is not None else DefaultLoadPlanner()
        every = _exchange(self.group, self.world, f"restore: planning the load of step {self.s}",
                          lambda: tplan.reads_to_wire(tplan.reads(self.ctx.state_dict, self.metadata, self.layout,
                                                                  load_planner, self.rank == 0)),
                          spec=tplan.READS_SPEC)
        reads = [tplan.reads_from_wire(r) for r in every]
        try:
            self.needs = tplan.node_needs(self.topology, reads, self.sizes, self.s)
        except ValueError as e:
            raise TierRestoreError(str(e)) from None
        self.mine = reads[self.rank]
        self.phases["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        incoming = self._assemble(self.needs, background=True)
        self.phases["assemble"] = time.perf_counter() - t
        t = time.perf_counter()
        while True:
            failed = self._load(incoming)
            incoming = None
            if not failed:
                break
            self._assemble(failed)
        self.phases["load"] = time.perf_counter() - t
        mine = [[n.node, n.name, self.chosen[(n.node, n.name)], ranges_bytes(n.ranges)] for n in self.needs
                if n.receiver == self.rank]
        everyone = wire.gather((self.taken, mine), tplan.TAKEN_SPEC, self.group, what="restore: what each rank took")
        job = {t: sum(taken.get(t, 0) for taken, _ in everyone) for t in TIERS}
        sources = sorted(Source(*src) for _, srcs in everyone for src in srcs)
        return RestoreResult(self.s, self.save_id, self.taken, self.skipped, 0.0, job, self.phases, sources)

    def _fresh_dir(self) -> None:
        def make() -> None:
            if self.leader:  # the tiers' own, or refused (a link, a folder of the user's)
                store.remove_owned(self.ctx.local_root, None, store.RESTORE_DIR)
                store.claim_dir(self.ctx.local_root, store.RESTORE_DIR, None)

        _exchange(self.group, self.world, "restore: preparing the restore directory", make)

    def _metadata(self) -> None:
        """The step's metadata, from one rank that holds it to all."""
        inv, s = self.ctx.inventory, self.s
        src = next((r for r in range(self.world) if inv.has_metadata(r, s, self.save_id)), 0)
        root = self.ctx.local_root if inv.has_metadata(self.rank, s, self.save_id) else self.ctx.persistent_root

        def read() -> bytes:
            assert root is not None  # src holds the metadata in one of its tiers
            return store.read_metadata(store.step_dir(root, s))

        blob = share(self.group, src, f"restore: reading step {s}'s metadata", read, error=TierRestoreError)
        self.metadata, self.layout, self.extra = store.decode(blob, f"step {s} metadata (from rank {src})")
        self.fid_of = {n: i for i, (n, _) in enumerate(self.layout.files)}

    # ---------------------------------------------------------- assembly

    def _assemble(self, pending: list[Need], background: bool = False) -> concurrent.futures.Future | None:
        """Fetch ``pending`` from the fastest good source of each, in rounds, until
        every one is in its node's restore directory (:class:`_Unloadable` when a
        need has no good source left).  With ``background``, may return the future
        of replica transfers still running, for the load to overlap."""
        while pending:
            picks: list[Pick] = []
            missing = []
            sending: dict[int, int] = {}  # bytes each holder sends this round: the next goes to the least busy
            for need in sorted(pending, key=lambda n: (-ranges_bytes(n.ranges), n.node, n.name)):
                pick = self._pick(need, sending)
                if pick is None:
                    missing.append(need)
                else:
                    picks.append(pick)
            if missing:
                names = sorted({m.name for m in missing})
                raise _Unloadable("no tier holds a good copy of " + ", ".join(
                    f"{n} (tried: {'; '.join(self.tried.get(n, [])) or 'no tier holds it'})" for n in names))
            picks.sort(key=lambda p: (p.need.node, p.need.name))  # the transfers' global order
            for p in picks:
                self.chosen[(p.need.node, p.need.name)] = p.tier
            local_failures = _failures(self.group, self.world, f"restore: assembling step {self.s}",
                                       lambda: self._fetch_here(picks))  # noqa: B023 (called before the loop goes on)
            if background and not local_failures:
                return self._start_transfers(picks)
            moved = _failures(self.ctx.moving, self.world, f"restore: moving replicas of step {self.s}",
                              lambda: self._transfers(picks))  # noqa: B023 (called before the loop goes on)
            failed = self._mark_bad(sorted(set(local_failures) | set(moved)))
            pending = [p.need for p in picks if (p.need.receiver, p.need.name) in failed]
        return None

    def _start_transfers(self, picks: list[Pick]) -> concurrent.futures.Future | None:
        """The replica copies of ``picks`` on a thread of their own: a future of
        every rank's failed copies (``None`` when there is none)."""
        if not any(p.tier == "replica" for p in picks):
            return None
        # the current CUDA device is per thread: the NCCL transport's tensors
        # go on the caller's, not on the new thread's default one
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def work() -> list[Failure]:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            t = time.perf_counter()
            try:
                return _failures(self.ctx.moving, self.world, f"restore: moving replicas of step {self.s}",
                                 lambda: self._transfers(picks))
            finally:
                self.phases["replicas"] = time.perf_counter() - t

        pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-moves")
        try:
            return pool.submit(work)
        finally:
            pool.shutdown(wait=False)

    def _fetch_here(self, picks: list[Pick]) -> list[Failure]:
        """This rank's local and persistent copies, and the empty files of the
        replica copies it will receive.  Returns the copies that failed their
        checks; any other error raises."""
        failures = []
        self.receiving = {}
        for pick in picks:
            need = pick.need
            if need.receiver != self.rank:
                continue
            dst = os.path.join(self.restore_dir, need.name)
            fid = self.fid_of[need.name]
            if pick.tier == "replica":
                self.receiving[need.name] = store.RangesFile(dst, self.sizes[need.name])
                continue
            source = _source_key(pick.tier, pick.src, self.topology)
            try:
                try:
                    _hook(f"{pick.tier} {need.name}")
                    if pick.tier == "local":
                        path = os.path.join(self.local_dir, need.name)
                        if need.check:  # what the load will not verify whole
                            integrity.check_file(path, self.layout, fid, need.check)
                        _link_or_copy(path, dst)
                    else:
                        assert self.pers_dir is not None
                        integrity.copy_checked(os.path.join(self.pers_dir, need.name), dst, self.layout, fid,
                                               sync=False, ranges=need.ranges)
                except OSError as e:
                    failures.append(Failure(need.name, source, str(e), self.rank))
                    continue
            except Exception as e:
                raise TierRestoreError(f"{need.name} from {source}: {type(e).__name__}: {e}") from e
            self.taken[pick.tier] += ranges_bytes(need.ranges)
        return failures

    def _transfers(self, picks: list[Pick]) -> list[Failure]:
        """The replica copies of ``picks`` over ``ctx.bytes_group``
        (:class:`~fp_dcp.tiers.moves.ReplicaMoves`); this rank's failed copies."""
        moves = ReplicaMoves(picks, rank=self.rank, layout=self.layout, local_dir=self.local_dir,
                             receiving=self.receiving, file_io=self._file_io, chunk_bytes=CHUNK_BYTES,
                             source_of=lambda src: _source_key("replica", src, self.topology), hook=_hook)
        try:
            return moves.run(self.ctx.bytes_group)
        finally:
            self.taken["replica"] += moves.taken

    def _file_io(self) -> FileIO:
        """How this rank reads the replicas it sends: O_DIRECT into reused buffers."""
        if self._io is None:
            self._io = FileIO(self.ctx.options or FastPersistOptions.from_env(), self.restore_dir)
        return self._io

    def _mark_bad(self, failures: list[Failure]) -> set[tuple[int, str]]:
        """Record every rank's failed copies (the same list on every rank);
        returns the ``(receiver, file)`` pairs to fetch again."""
        for f in failures:
            self.bad.add((f.name, f.source))
            self.skipped.append(f"{f.name} from {f.source}, for rank {f.rank}: {f.why}")
            self.tried.setdefault(f.name, []).append(f"{f.source}: {f.why}")
        return {(f.rank, f.name) for f in failures}

    def _pick(self, need: Need, sending: dict[int, int]) -> Pick | None:
        """The fastest good source of a file for a node: its own local tier, a
        replica on another node (the holder with the fewest bytes to send so
        far, ``sending``, which this updates), the persistent tier."""
        topology, inv, size = self.topology, self.ctx.inventory, self.sizes[need.name]
        if inv.holds(need.receiver, self.s, need.name, size) \
                and (need.name, _source_key("local", need.receiver, topology)) not in self.bad:
            return Pick(need, "local", need.receiver)
        others = [r for r in range(self.world) if topology.node_of(r) != need.node
                  and inv.holds(r, self.s, need.name, size)
                  and (need.name, _source_key("replica", r, topology)) not in self.bad]
        if others:
            src = min(others, key=lambda r: (sending.get(r, 0), zlib.crc32(f"{need.node}/{need.name}/{r}".encode())))
            sending[src] = sending.get(src, 0) + ranges_bytes(need.ranges)
            return Pick(need, "replica", src)
        if inv.persistent_holds(self.s, need.name, size) and (need.name, "the persistent tier") not in self.bad:
            return Pick(need, "persistent", -1)
        return None

    # -------------------------------------------------------------- load

    def _load(self, incoming: concurrent.futures.Future | None) -> list[Need]:
        """``dcp.load`` of every node's assembled files; ``[]`` when it loaded, else
        the copies found bad (failed transfers, or local copies that fail their
        checks), marked, to fetch from the next tier; no bad copy: the load's error
        is raised."""
        node_needs = [n for n in self.needs if n.node == self.node]
        try:
            if self.leader:
                held = {n.name: (None if self.chosen[(n.node, n.name)] == "local" else n.ranges) for n in node_needs}
                metadata = dataclasses.replace(self.metadata)
                metadata.storage_data = sub = subset_layout(self.layout, held)
                store.write_atomic(os.path.join(self.restore_dir, fmt.METADATA_NAME),
                                   fmt.encode_metadata(metadata, sub, self.extra), sync=False)
            dist.barrier(group=self.group)
            # every rank reads only its node's files (no shared reads) and
            # checks every block it reads whole (local copies rely on it); a
            # rank that reads only local copies reads them with O_DIRECT (the
            # disk straight into the state), the others through the page
            # cache (the assembly wrote the fetched files there)
            direct = all(self.chosen[(self.node, name)] == "local" for name in self.mine)
            opts = (self.ctx.options or FastPersistOptions.from_env()).replace(
                share_replicated_reads=False, share_interleaved_reads=False, verify_checksums=True,
                **({} if direct else {"direct_io": False}))
            waits = incoming is not None and any(self.chosen[(n.node, n.name)] == "replica" for n in node_needs)
            reader = _ArrivingReader(self.restore_dir, opts, functools.partial(self._arrived, incoming)
                                     if waits and incoming is not None else None)
            load_error = None
            try:  # what raises in here raises on every rank (DCP gathers every rank's outcome)
                dcp.load(self.ctx.state_dict, storage_reader=reader, planner=self.ctx.planner, process_group=self.group)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - below: a copy to fetch again, or raised
                load_error = e
        finally:
            moved = [] if incoming is None else incoming.result()  # raises on every rank when moving failed on one
        failed = self._mark_bad(moved)  # never named: fetched again
        redo = [need for need in self.needs if (need.receiver, need.name) in failed]
        if not redo and load_error is not None:
            flat = _failures(self.group, self.world, f"restore: checking step {self.s}'s local copies after a "
                             f"failed load", lambda: self._check_linked(node_needs))
            if not flat:
                raise load_error
            after = f"(found after the load failed: {_first_line(load_error)})"
            failed = self._mark_bad([dataclasses.replace(f, why=f"{f.why} {after}") for f in flat])
            redo = [need for need in self.needs if (need.receiver, need.name) in failed]
            for need in redo:
                if need.receiver == self.rank:
                    self.taken["local"] -= ranges_bytes(need.ranges)
        for need in redo:
            if need.receiver == self.rank:
                store.unlink_in(os.path.join(self.restore_dir, need.name))
        dist.barrier(group=self.group)
        return redo

    def _arrived(self, incoming: concurrent.futures.Future) -> None:
        """Wait for the replica transfers (on a rank whose node receives
        some); raise when a copy this node needs failed."""
        t = time.perf_counter()
        try:
            moved = incoming.result()
        finally:
            self.phases["wait"] = time.perf_counter() - t
        ours = sorted({f.name for f in moved if self.topology.node_of(f.rank) == self.node})
        if ours:
            raise OSError(f"restore: {', '.join(ours)} did not arrive good from a replica; fetching again")

    def _check_linked(self, node_needs: list[Need]) -> list[Failure]:
        failures = []
        for need in node_needs:
            if need.receiver != self.rank or self.chosen[(need.node, need.name)] != "local":
                continue
            try:
                integrity.check_file(os.path.join(self.restore_dir, need.name), self.layout, self.fid_of[need.name],
                                     need.ranges)
            except OSError as e:
                failures.append(Failure(need.name, _source_key("local", self.rank, self.topology), str(e), self.rank))
        return failures


class _ArrivingReader(FastPersistReader):
    """A :class:`FastPersistReader` whose ``read_data`` first waits for
    ``arrived()`` (this node's received files complete and checked)."""

    def __init__(self, path: str, options: FastPersistOptions, arrived: Callable[[], None] | None) -> None:
        super().__init__(path, options=options)
        self._arrived = arrived

    def read_data(self, plan, planner):
        if self._arrived is not None:
            self._arrived()
        return super().read_data(plan, planner)


def _source_key(tier: str, src: int, topology: Topology) -> str:
    """A source as failures name it: a file bad on a node is bad for every
    rank of that node (they share its local directory)."""
    if tier == "persistent":
        return "the persistent tier"
    return f"node {topology.node_of(src)}'s local tier"


def _link_or_copy(src: str, dst: str) -> None:
    """``src`` (a scanned local-tier file) at ``dst``: a hard link, else a copy;
    no link followed (one swapped in is refused by the load)."""
    with store.opened(os.path.dirname(src)) as sdir, store.opened(os.path.dirname(dst)) as ddir:
        try:
            os.link(os.path.basename(src), os.path.basename(dst), src_dir_fd=sdir.fd, dst_dir_fd=ddir.fd,
                    follow_symlinks=False)
            return
        except FileExistsError:
            raise
        except OSError:
            pass  # another file system, or no hard links: a copy
        fd, st = sdir.open_read(os.path.basename(src))
        try:
            out = ddir.create_exclusive(os.path.basename(dst))
            try:
                done = 0
                while done < st.st_size:
                    n = os.copy_file_range(fd, out, st.st_size - done, done, done)
                    if n == 0:
                        break
                    done += n
            finally:
                os.close(out)
        finally:
            os.close(fd)


def _first_line(e: BaseException) -> str:
    """An exception's first line: DCP's ``CheckpointException`` carries every
    rank's traceback, and the reason it names is already in the message."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
