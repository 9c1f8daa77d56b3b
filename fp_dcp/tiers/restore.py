"""Restoring from the fastest complete tier, on any world size.

Every rank calls :func:`restore` (the manager's ``restore``), with nothing
else running on the tiers' process group:

1. *Inventory.*  Each rank scans its node's local root (steps, metadata,
   data files, sizes); rank 0 also scans the persistent root.  All ranks
   gather every inventory.
2. *Agreement.*  From the same gathered facts every rank picks the same
   step: the newest whose metadata exists somewhere and each of whose data
   files is held, with its recorded size, by some node or by the
   persistent tier.
3. *Needs.*  The metadata travels from one holder to all; each rank plans
   its load with the DCP load planner against it (the state dict it will
   load, so any world size and sharding) and lists the extents its read
   items touch, by data file: a node needs only those bytes of a file, not
   all of it (a replicated item, such as an optimizer's step counter, is
   saved once, in some rank's file: a node may need a few bytes of every
   file).
4. *Assembly.*  Each node gathers the extents its ranks need into
   ``<local root>/.restore/``: a file its own local tier holds is
   hard-linked; one held only by other nodes comes from one of them over
   the process group (:mod:`fp_dcp.tiers.replicate`), only the extents
   needed, in parts, each checked on arrival and written at its offsets
   (the rest of the file a hole); the persistent tier, the same way, only for what no
   node holds.  A copy that fails its checks is skipped (named in
   ``RestoreResult.skipped``) and fetched from the next source, in rounds
   that every rank runs alike.
5. *Load.*  The node's directory gets a metadata of the same save that
   names only the files assembled there and the items whose extents they
   hold, and ``dcp.load`` reads it through ``FastPersistReader`` with
   ``verify_checksums`` on: every check of a normal load applies (names of
   this save only, no links, checksums).  The load overlaps the replica
   transfers of step 4, which run on a thread of their own (over a gloo
   group the restore makes at the caller's priority): the ranks of a node
   that receives wait in the load's ``read_data`` until every transfer
   ended; the others read their local copies at once.

Checks: bytes that crossed from another node or from the persistent tier
are checked against the metadata's CRCs before they are named.  A local
copy is not read twice: the load's own verification checks every block of
the items it reads whole (:func:`fp_dcp.load.jobs.whole_chunk_read`); the
extents it reads only in part (resharding) are checked at assembly.  When
the load fails, each node checks the local copies it linked; a bad one is
marked, named in ``skipped``, fetched from the next tier, and the load
runs again.  The bytes a restore returns are never unchecked.

Fallback: when no tier holds a good copy of something a step needs, every
rank (they all know it from the same gathered facts) passes over that step
to the next older one complete somewhere, and ``skipped`` says which step
was passed over and why; when no step loads, :class:`TierRestoreError`
names the files and the tiers tried.

Failures surface at once: each phase's local work (scan, planning,
assembly, the checks after a failed load) ends with an exchange of every
rank's outcome, so a rank whose work raised makes every rank raise
:class:`TierRestoreError` naming it, the file and the error, instead of
leaving the others in a collective until the group's timeout.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import os
import time
import zlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable

import numpy as np

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from fp_dcp import FastPersistOptions, FastPersistReader
from fp_dcp import format as fmt
from fp_dcp.load.jobs import whole_chunk_read
from fp_dcp.tiers import integrity, store
from fp_dcp.tiers.agree import TierError, exchange
from fp_dcp.tiers.integrity import extent_ranges, ranges_bytes
from fp_dcp.tiers.replicate import FileIO, Transfer, run_transfers
from fp_dcp.tiers.topology import Topology

__all__ = ["RestoreResult", "restore", "TierRestoreError"]

TIERS = ("local", "replica", "persistent")

#: The most bytes of a replica sent as one part (each part checked on
#: arrival): the holder reads the next part while this one crosses, the
#: receiver checks and writes it while the next arrives.
CHUNK_BYTES = 32 << 20

#: Tests: called with ``"local NAME"``, ``"send NAME"`` or ``"persistent
#: NAME"`` on the rank about to read that copy of data file NAME.
fault_hook: Callable[[str], None] | None = None


class TierRestoreError(TierError):
    """No step is loadable from the tiers, or a rank failed during a restore
    (the message names it, the file and the error)."""


# every phase of a restore ends with every rank's outcome (fp_dcp.tiers.agree)
_exchange = functools.partial(exchange, error=TierRestoreError)


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
    sources: list[tuple[int, str, str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Need:
    """What node ``node`` needs of data file ``name``: ``ranges`` (whole
    extents its ranks read), of which ``check`` the load reads only in part
    (so will not verify whole).  ``receiver``: the rank that fetches it."""

    node: int
    name: str
    receiver: int
    ranges: tuple[tuple[int, int], ...]
    check: tuple[tuple[int, int], ...]


class _Unloadable(Exception):
    """No tier holds a good copy of something this step needs (every rank
    raises it alike, from gathered facts)."""


def _holding_doc(holdings: dict[int, store.Holding]) -> dict[int, Any]:
    return {s: (h.save_id, h.meta_files, h.files) for s, h in holdings.items()}


def _choose(step: int | None, invs: list[dict], pers: dict[int, Any],
            excluded: set[int] = frozenset()) -> tuple[int, str, list] | None:
    """The newest step complete somewhere: ``(step, save_id, files)``."""
    candidates: dict[tuple[int, str], list] = {}
    for inv in invs + [pers]:
        for s, (sid, meta_files, _) in inv.items():
            if sid is not None:
                candidates.setdefault((s, sid), meta_files)
    for (s, sid), files in sorted(candidates.items(), key=lambda kv: kv[0][0], reverse=True):
        if (step is not None and s != step) or s in excluded:
            continue
        # every file present at its recorded size in some tier
        ok = all(any(inv.get(s) and inv[s][2].get(n) == z for inv in invs + [pers]) for n, z in files)
        if ok:
            return s, sid, files
    return None


def _reads(state_dict: dict, metadata, layout: fmt.StorageLayout, planner, is_coordinator: bool) -> dict[str, tuple]:
    """The extents this rank's load plan reads, by data file: ``name ->
    (ranges, check)``, ``check`` the ranges the reader will not verify
    whole (items read in part, or into a target it reads through a grid)."""
    planner.set_up_planner(state_dict, metadata, is_coordinator)
    plan = planner.create_local_plan()
    out: dict[str, tuple[list, list]] = {}
    for item in plan.items:
        idx = MetadataIndex(item.storage_index.fqn, item.storage_index.offset)
        exts = layout.extents.get(idx)
        if exts is None:
            raise fmt.CheckpointFormatError(f"{item.storage_index.fqn}: the checkpoint has no extents for it")
        verified = item.type == LoadItemType.BYTE_IO or _read_whole(item, metadata, planner)
        for e in exts:
            spans, check = out.setdefault(layout.files[e.file][0], ([], []))
            spans.append((e.file_offset, e.length))
            if not verified:
                check.append((e.file_offset, e.length))
    return {name: (extent_ranges(a), extent_ranges(b)) for name, (a, b) in out.items()}


def _read_whole(item, metadata, planner) -> bool:
    """Whether the reader reads ``item``'s stored chunk as its extents whole
    (and so checks every block of them)."""
    md = metadata.state_dict_metadata.get(item.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return False
    want = item.storage_index.offset
    chunk = next((c for c in md.chunks if want is None or list(c.offsets) == list(want)), None)
    try:
        dest = planner.resolve_tensor(item)
    except Exception:  # noqa: BLE001 - a planner that cannot say: check it at assembly
        return False
    if chunk is None or not isinstance(dest, torch.Tensor):
        return False
    return whole_chunk_read(chunk.sizes, md.properties.dtype, item.storage_offsets, item.lengths, dest.detach())


def subset_layout(layout: fmt.StorageLayout, held: Any) -> fmt.StorageLayout:
    """``layout`` with only the files ``held`` and the items whose extents
    they hold.  ``held``: file names (held whole) or ``{name: ranges}``
    (only those ``(offset, length)`` ranges held)."""
    ranges: Mapping = held if isinstance(held, Mapping) else {n: None for n in held}
    keep = [fid for fid, (n, _) in enumerate(layout.files) if n in ranges]
    new_id = {old: new for new, old in enumerate(keep)}
    starts = {fid: [o for o, _ in ranges[layout.files[fid][0]]] for fid in keep
              if ranges[layout.files[fid][0]] is not None}

    def inside(e) -> bool:
        if e.file not in new_id:
            return False
        if e.file not in starts:
            return True
        r = ranges[layout.files[e.file][0]]
        i = bisect.bisect_right(starts[e.file], e.file_offset) - 1
        return i >= 0 and e.file_offset + e.length <= r[i][0] + r[i][1]

    extents = {
        idx: [dataclasses.replace(e, file=new_id[e.file]) for e in exts]
        for idx, exts in layout.extents.items()
        if all(inside(e) for e in exts)
    }
    return dataclasses.replace(layout, files=[layout.files[f] for f in keep], extents=extents)


def restore(state_dict: dict, *, rank: int, topology: Topology, local_root: str, persistent_root: str | None,
            group, bytes_group=None, planner=None, step: int | None = None,
            options: FastPersistOptions | None = None, timeout: timedelta | None = None) -> RestoreResult | None:
    """``group``: a gloo group of every rank for the restore's own
    collectives and ``dcp.load``; ``bytes_group``: the group replicas move
    over (an NCCL group, or ``None``/``group``: gloo); ``timeout``: that of
    the gloo group the restore makes for the replicas' transfers (the
    default: torch's)."""
    t0 = time.perf_counter()
    world = dist.get_world_size(group)

    def inventory():
        mine = _holding_doc(store.scan(local_root))
        pers = {}
        if rank == 0 and persistent_root is not None:
            pers = {s: d for s, d in _holding_doc(store.scan(persistent_root)).items() if d[0] is not None}
        return mine, pers

    # the transfers' gloo group (see _StepRestore), made while the tiers are
    # scanned, on a thread started here: its threads (gloo's, which move the
    # bytes) run at the caller's priority, not the manager's background one
    pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-group")
    making = pool.submit(dist.new_group, backend="gloo", **({} if timeout is None else {"timeout": timeout}))
    pool.shutdown(wait=False)
    try:
        gathered = _exchange(group, world, "restore: taking stock of the tiers", inventory)
        invs = [g[0] for g in gathered]
        pers = gathered[0][1]
        passed: list[str] = []  # steps passed over, and why
        excluded: set[int] = set()
        while True:
            chosen = _choose(step, invs, pers, excluded)
            if chosen is None:
                if passed:
                    raise TierRestoreError("no step is loadable from the tiers: " + "; ".join(passed))
                if step is not None:
                    raise TierRestoreError(f"step {step} is complete in no tier (local, replicas, persistent)")
                return None
            s, save_id, files = chosen
            attempt = _StepRestore(state_dict, rank, world, topology, local_root, persistent_root, group,
                                   making.result(), bytes_group, planner, options, invs, pers, s, save_id, files)
            attempt.phases["agree"] = time.perf_counter() - t0
            try:
                result = attempt.run()
            except _Unloadable as e:
                passed.append(f"step {s}: {e}")
                excluded.add(s)
                if step is not None:
                    raise TierRestoreError(f"step {s} is not loadable: {e}") from None
                continue
            result.skipped = [f"passed over {p}" for p in passed] + result.skipped
            result.seconds = time.perf_counter() - t0
            return result
    finally:
        dist.destroy_process_group(making.result())


class _StepRestore:
    """One attempt at restoring step ``s`` (phases 3 to 5)."""

    def __init__(self, state_dict, rank, world, topology: Topology, local_root, persistent_root, group, moving,
                 bytes_group, planner, options, invs, pers, s, save_id, files) -> None:
        self.state_dict, self.rank, self.world, self.topology = state_dict, rank, world, topology
        self.group, self.planner, self.options = group, planner, options
        # the replicas' transfers run on a thread of their own while the load
        # runs on this one (group): their collectives go over ``moving``, their
        # bytes too unless an NCCL group carries them
        self.moving = moving
        self.bytes_group = moving if bytes_group is None or bytes_group is group else bytes_group
        self.invs, self.pers, self.s, self.save_id = invs, pers, s, save_id
        self.sizes = dict(files)
        self.node = topology.node_of(rank)
        self.leader = topology.leader(self.node) == rank
        self.restore_dir = os.path.join(local_root, store.RESTORE_DIR)
        self.local_dir = store.step_dir(local_root, s)
        self.pers_dir = None if persistent_root is None else store.step_dir(persistent_root, s)
        self.local_root, self.persistent_root = local_root, persistent_root
        self.phases: dict[str, float] = {}
        self.bad: set[tuple[str, str]] = set()  # (file, source)
        self.skipped: list[str] = []
        self.tried: dict[str, list[str]] = {}  # file -> "source: why" of every copy passed over
        self.taken = {t: 0 for t in TIERS}  # this rank's, of the copies in use
        self.chosen: dict[tuple[int, str], str] = {}  # (node, file) -> tier of the copy in use (every rank knows)
        self.receiving: dict[str, store.RangesFile] = {}  # the replica copies this rank receives this round

    # ------------------------------------------------------------ phases

    def run(self) -> RestoreResult:
        self._fresh_dir()
        try:
            return self._run()
        finally:
            for f in self.receiving.values():  # left by a failure
                f.discard()
            if "_file_io" in self.__dict__:
                self._file_io.close()
            if self.leader:
                store.remove_owned(self.local_root, None, store.RESTORE_DIR)

    def _run(self) -> RestoreResult:
        t = time.perf_counter()
        self._metadata()
        load_planner = self.planner if self.planner is not None else DefaultLoadPlanner()
        reads = _exchange(self.group, self.world, f"restore: planning the load of step {self.s}",
                          lambda: _reads(self.state_dict, self.metadata, self.layout, load_planner, self.rank == 0))
        self.needs = self._node_needs(reads)
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
        everyone: list = [None] * self.world
        mine = [(n.node, n.name, self.chosen[(n.node, n.name)], ranges_bytes(n.ranges)) for n in self.needs
                if n.receiver == self.rank]
        dist.all_gather_object(everyone, (self.taken, mine), group=self.group)
        job = {t: sum(x[0][t] for x in everyone) for t in TIERS}
        sources = sorted(src for x in everyone for src in x[1])
        return RestoreResult(self.s, self.save_id, self.taken, self.skipped, 0.0, job, self.phases, sources)

    def _fresh_dir(self) -> None:
        def make() -> None:
            if self.leader:  # the tiers' own, or refused (a link, a folder of the user's)
                store.remove_owned(self.local_root, None, store.RESTORE_DIR)
                store.claim_dir(self.local_root, store.RESTORE_DIR, None)

        _exchange(self.group, self.world, "restore: preparing the restore directory", make)

    def _metadata(self) -> None:
        """The step's metadata, from one rank that holds it to all."""
        s, invs = self.s, self.invs
        src = next((r for r in range(self.world) if invs[r].get(s) and invs[r][s][0] == self.save_id), 0)
        box: list = [None]
        if self.rank == src:
            ours = invs[self.rank].get(s) is not None and invs[self.rank][s][0] == self.save_id
            try:
                box = [(store.read_metadata(store.step_dir(self.local_root if ours else self.persistent_root, s)),
                        None)]
            except Exception as e:  # noqa: BLE001 - every rank learns it
                box = [(None, f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, group_src=src, group=self.group)
        blob, err = box[0]
        if err is not None:
            raise TierRestoreError(f"restore: rank {src} could not read step {s}'s metadata: {err}")
        self.metadata, self.layout, self.extra = store.decode(blob, f"step {s} metadata (from rank {src})")
        self.fid_of = {n: i for i, (n, _) in enumerate(self.layout.files)}

    def _node_needs(self, reads: list[dict]) -> list[_Need]:
        """Every node's needs, from every rank's reads.  A file's receiver
        is the rank of the node that reads most of it (each rank fetches
        its own shard's file, so the node's ranks fetch side by side)."""
        needs = []
        for node, ranks in enumerate(self.topology.nodes):
            per: dict[str, tuple[list, list, dict]] = {}
            for r in ranks:
                for name, (spans, check) in reads[r].items():
                    if name not in self.fid_of:
                        raise TierRestoreError(f"restore: rank {r} asked for {name!r}, not a file of step {self.s}")
                    a = per.setdefault(name, ([], [], {}))
                    a[0].extend(spans)
                    a[1].extend(check)
                    a[2][r] = ranges_bytes(spans)
            for name in sorted(per):
                spans, check, by_rank = per[name]
                receiver = min(by_rank, key=lambda r: (-by_rank[r], r))
                needs.append(_Need(node, name, receiver, tuple(extent_ranges(spans)), tuple(extent_ranges(check))))
        return needs

    # ---------------------------------------------------------- assembly

    def _assemble(self, pending: list[_Need], background: bool = False) -> concurrent.futures.Future | None:
        """Fetch ``pending`` from the fastest good source of each, in rounds
        (a copy that fails goes to the next source) until every one is in
        its node's restore directory; :class:`_Unloadable` when some need
        has no good source left.  With ``background``, a first round whose
        local and persistent copies all succeeded leaves its replica
        transfers running on a thread and returns their future (every
        rank's failed copies, :meth:`_start_transfers`), for the load to
        overlap."""
        while pending:
            plan: list[tuple[_Need, str, int]] = []
            missing = []
            sending: dict[int, int] = {}  # bytes each holder sends this round: the next goes to the least busy
            for need in sorted(pending, key=lambda n: (-ranges_bytes(n.ranges), n.node, n.name)):
                src = self._pick(need, sending)
                if src is None:
                    missing.append(need)
                else:
                    plan.append((need, *src))
            if missing:
                names = sorted({m.name for m in missing})
                raise _Unloadable("no tier holds a good copy of " + ", ".join(
                    f"{n} (tried: {'; '.join(self.tried.get(n, [])) or 'no tier holds it'})" for n in names))
            plan.sort(key=lambda p: (p[0].node, p[0].name))  # the transfers' global order
            for need, tier, _ in plan:
                self.chosen[(need.node, need.name)] = tier
            local_failures = _exchange(self.group, self.world, f"restore: assembling step {self.s}",
                                       lambda: self._fetch_here(plan))
            if background and not any(local_failures):
                return self._start_transfers(plan)
            moved = _exchange(self.moving, self.world, f"restore: moving replicas of step {self.s}",
                              lambda: self._transfers(plan))
            failed = self._mark_bad(sorted({f for fs in local_failures + moved for f in fs}))
            pending = [need for need, _, _ in plan if (need.receiver, need.name) in failed]
        return None

    def _start_transfers(self, plan) -> concurrent.futures.Future | None:
        """The replica copies of ``plan`` on a thread of their own (its
        collectives on ``self.moving``, none on ``self.group``): a future of
        every rank's failed copies, raising :class:`TierRestoreError` on
        every rank when a transfer raised on some rank.  ``None`` when the
        plan has no replica copy."""
        if not any(tier == "replica" for _, tier, _ in plan):
            return None
        # the current CUDA device is per thread: the NCCL transport's tensors
        # go on the caller's, not on the new thread's default one
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def work():
            if cuda is not None:
                torch.cuda.set_device(cuda)
            t = time.perf_counter()
            try:
                return _exchange(self.moving, self.world, f"restore: moving replicas of step {self.s}",
                                 lambda: self._transfers(plan))
            finally:
                self.phases["replicas"] = time.perf_counter() - t

        pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-moves")
        try:
            return pool.submit(work)
        finally:
            pool.shutdown(wait=False)

    def _fetch_here(self, plan) -> list[tuple[str, str, str, int]]:
        """This rank's copies from its node's local tier and from the
        persistent tier, and the files of the replica copies it will
        receive, created empty (:meth:`_transfers` fills them; the load,
        whose metadata read wants every file there, reads them only once
        they are whole and checked).  A copy that fails its checks is
        returned as ``(file, source, why, rank)``; any other error raises."""
        failures = []
        self.receiving = {}
        for need, tier, src in plan:
            if need.receiver != self.rank:
                continue
            if tier == "replica":
                fid = self.fid_of[need.name]
                self.receiving[need.name] = store.RangesFile(os.path.join(self.restore_dir, need.name),
                                                             self.layout.files[fid][1])
                continue
            fid = self.fid_of[need.name]
            dst = os.path.join(self.restore_dir, need.name)
            source = _source_key(tier, src, self.topology)
            try:
                try:
                    if fault_hook is not None:
                        fault_hook(f"{tier} {need.name}")
                    if tier == "local":
                        path = os.path.join(self.local_dir, need.name)
                        if need.check:  # what the load will not verify whole
                            integrity.check_file(path, self.layout, fid, need.check)
                        _link_or_copy(path, dst)
                    else:
                        integrity.copy_checked(os.path.join(self.pers_dir, need.name), dst, self.layout, fid,
                                               sync=False, ranges=need.ranges)
                except OSError as e:
                    failures.append((need.name, source, str(e), self.rank))
                    continue
            except Exception as e:
                raise TierRestoreError(f"{need.name} from {source}: {type(e).__name__}: {e}") from e
            self.taken[tier] += ranges_bytes(need.ranges)
        return failures

    def _transfers(self, plan) -> list[tuple[str, str, str, int]]:
        """The replica copies of ``plan`` over ``self.bytes_group``: each
        holder reads the extents a node needs and sends them, in parts of
        at most ``CHUNK_BYTES``; the node's receiver checks each part and
        writes it at its offsets, and names the file when every part
        arrived good.  Three stages overlap on each side: the holder reads
        the next part (O_DIRECT, :class:`_ReadAhead`) while this one is
        sent; the receiver checks and writes a part on a thread of its own
        while the next one arrives.  This rank's failed copies:
        ``(file, source, why, rank)``."""
        parts: dict[tuple[int, str], tuple[_Need, list, int, bool]] = {}  # (receiver, transfer) -> need, ranges, k, last?
        transfers = []
        for need, tier, src in plan:
            if tier != "replica":
                continue
            split = integrity.split_ranges(self.layout, self.fid_of[need.name], need.ranges, CHUNK_BYTES)
            for k, ranges in enumerate(split):
                t = Transfer(src, need.receiver, f"{need.name}:{k}", ranges_bytes(ranges))
                parts[(t.dst, t.name)] = (need, ranges, k, k == len(split) - 1)
                transfers.append(t)
        sends = [t for t in transfers if t.src == self.rank != t.dst]
        receives = [t for t in transfers if t.dst == self.rank != t.src]
        if not sends and not receives:
            return []  # (receives none: self.receiving is empty)
        files = self.receiving  # being received, every part so far good (then closed and dropped)
        arrived: dict[str, int] = {}  # parts received good, by file
        failures: dict[str, tuple[int, int, str]] = {}  # file -> (part, sender, why) of its first failed part
        ahead = _ReadAhead(self._file_io if sends else None,
                           [(os.path.join(self.local_dir, parts[(t.dst, t.name)][0].name), parts[(t.dst, t.name)][1])
                            for t in sends])
        # two receive buffers in turn: one being received into, one checked and written
        size = max((t.size for t in receives), default=0)
        buffers = [np.empty(size if receives else 0, dtype=np.uint8) for _ in range(2)]
        jobs: list[concurrent.futures.Future | None] = [None, None]
        turn = [0]
        writer = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-write") if receives else None

        def read(t: Transfer) -> Any:
            data = ahead.take()
            if fault_hook is not None:
                fault_hook(f"send {parts[(t.dst, t.name)][0].name}")
            return data.result()

        def receive_buffer(t: Transfer) -> np.ndarray:
            slot = turn[0] % 2
            if jobs[slot] is not None:
                jobs[slot].result()  # the part received into it two parts ago is written
            return buffers[slot][: t.size]

        def receive(t: Transfer, data: Any) -> None:
            slot = turn[0] % 2
            turn[0] += 1
            assert writer is not None
            jobs[slot] = writer.submit(check_and_write, t, data)

        def check_and_write(t: Transfer, data: Any) -> None:
            need, ranges, k, last = parts[(t.dst, t.name)]
            if need.name in failures:  # an earlier part failed: the file comes from the next source
                return
            if arrived.get(need.name, 0) != k:  # an earlier part never came (its sender failed)
                failures[need.name] = (k, t.src, f"part {arrived.get(need.name, 0)} did not arrive")
                return
            fid = self.fid_of[need.name]
            try:
                integrity.check_buffer(data, self.layout, fid, f"{need.name} from rank {t.src}", ranges=ranges)
                files[need.name].write(ranges, data)
            except Exception as e:  # noqa: BLE001 - this copy fails; the file comes from the next source
                failures[need.name] = (k, t.src, str(e))
                return
            arrived[need.name] = k + 1
            if last:
                files.pop(need.name).close()
                self.taken["replica"] += ranges_bytes(need.ranges)

        try:
            _, failed = run_transfers(transfers, self.rank, self.bytes_group, read, receive,
                                      receive_buffer=receive_buffer)
            if writer is not None:
                writer.shutdown(wait=True)  # every part received is checked and written
            for t, why in failed.items():  # a part that failed in run_transfers (its sender could not read it)
                if t.dst == self.rank:
                    need, _, k, _ = parts[(t.dst, t.name)]
                    if need.name not in failures or failures[need.name][0] > k:
                        failures[need.name] = (k, t.src, why)
        finally:
            if writer is not None:
                writer.shutdown(wait=True)
            ahead.close()
            for f in files.values():  # not whole, or not good: removed, never read
                f.discard()
            files.clear()
        return [(name, _source_key("replica", src, self.topology), why, self.rank)
                for name, (_, src, why) in sorted(failures.items())]

    @functools.cached_property
    def _file_io(self) -> FileIO:
        """How this rank reads the replicas it sends: O_DIRECT into reused buffers."""
        return FileIO(self.options or FastPersistOptions.from_env(), self.restore_dir)

    def _mark_bad(self, failures) -> set[tuple[int, str]]:
        """Record every rank's failed copies (the same list on every rank);
        returns the ``(receiver, file)`` pairs to fetch again."""
        for name, source, why, receiver in failures:
            self.bad.add((name, source))
            self.skipped.append(f"{name} from {source}, for rank {receiver}: {why}")
            self.tried.setdefault(name, []).append(f"{source}: {why}")
        return {(receiver, name) for name, _, _, receiver in failures}

    def _pick(self, need: _Need, sending: dict[int, int]) -> tuple[str, int] | None:
        """The fastest good source of a file for a node: its own local tier, a
        replica on another node (the holder with the fewest bytes to send so
        far, ``sending``, which this updates), the persistent tier."""
        topology, s = self.topology, self.s
        if self._holds(need.receiver, need.name) \
                and (need.name, _source_key("local", need.receiver, topology)) not in self.bad:
            return "local", need.receiver
        others = [r for r in range(self.world) if topology.node_of(r) != need.node and self._holds(r, need.name)
                  and (need.name, _source_key("replica", r, topology)) not in self.bad]
        if others:
            src = min(others, key=lambda r: (sending.get(r, 0), zlib.crc32(f"{need.node}/{need.name}/{r}".encode())))
            sending[src] = sending.get(src, 0) + ranges_bytes(need.ranges)
            return "replica", src
        if self.pers.get(s) and self.pers[s][2].get(need.name) == self.sizes[need.name] \
                and (need.name, "the persistent tier") not in self.bad:
            return "persistent", -1
        return None

    def _holds(self, r: int, name: str) -> bool:
        h = self.invs[r].get(self.s)
        return h is not None and h[2].get(name) == self.sizes[name]

    # -------------------------------------------------------------- load

    def _load(self, incoming: concurrent.futures.Future | None) -> list[_Need]:
        """``dcp.load`` of every node's assembled files; ``[]`` when it
        loaded.  ``incoming``: replica transfers still running
        (:meth:`_start_transfers`): the ranks of a node that receives any
        wait for them in the load's ``read_data`` (:class:`_ArrivingReader`)
        while the other ranks already read; then every rank learns every
        failed copy, which is marked and returned (to fetch from the next
        tier).  When the load failed otherwise (on every rank: DCP shares
        the outcome), each node checks the local copies it linked: the bad
        ones are marked and returned; none bad: the load's error is
        raised."""
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
            opts = (self.options or FastPersistOptions.from_env()).replace(
                share_replicated_reads=False, share_interleaved_reads=False, verify_checksums=True,
                **({} if direct else {"direct_io": False}))
            waits = incoming is not None and any(self.chosen[(n.node, n.name)] == "replica" for n in node_needs)
            reader = _ArrivingReader(self.restore_dir, opts, functools.partial(self._arrived, incoming)
                                     if waits else None)
            load_error = None
            try:  # what raises in here raises on every rank (DCP gathers every rank's outcome)
                dcp.load(self.state_dict, storage_reader=reader, planner=self.planner, process_group=self.group)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - below: a copy to fetch again, or raised
                load_error = e
        finally:
            moved = [] if incoming is None else incoming.result()  # raises on every rank when moving failed on one
        failed = self._mark_bad(sorted({f for fs in moved for f in fs}))  # never named: fetched again
        redo = [need for need in self.needs if (need.receiver, need.name) in failed]
        if not redo and load_error is not None:
            failures = _exchange(self.group, self.world, f"restore: checking step {self.s}'s local copies after a failed load",
                                 lambda: self._check_linked(node_needs))
            flat = sorted({f for fs in failures for f in fs})
            if not flat:
                raise load_error
            failed = self._mark_bad([(n, src, f"{why} (found after the load failed: {load_error})", r)
                                     for n, src, why, r in flat])
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
        ours = sorted({name for fs in moved for name, _, _, r in fs if self.topology.node_of(r) == self.node})
        if ours:
            raise OSError(f"restore: {', '.join(ours)} did not arrive good from a replica; fetching again")

    def _check_linked(self, node_needs: list[_Need]) -> list[tuple[str, str, str, int]]:
        failures = []
        for need in node_needs:
            if need.receiver != self.rank or self.chosen[(need.node, need.name)] != "local":
                continue
            try:
                integrity.check_file(os.path.join(self.restore_dir, need.name), self.layout, self.fid_of[need.name],
                                     need.ranges)
            except OSError as e:
                failures.append((need.name, _source_key("local", self.rank, self.topology), str(e), self.rank))
        return failures


class _ArrivingReader(FastPersistReader):
    """:class:`FastPersistReader` whose ``read_data`` first waits until
    ``arrived()`` returns: the files this node receives are complete and
    checked (it raises when one failed, which fails the load on every
    rank).  DCP's planning, the other ranks' reads and the transfers run
    meanwhile."""

    def __init__(self, path: str, options: FastPersistOptions, arrived: Callable[[], None] | None) -> None:
        super().__init__(path, options=options)
        self._arrived = arrived

    def read_data(self, plan, planner):
        if self._arrived is not None:
            self._arrived()
        return super().read_data(plan, planner)


class _ReadAhead:
    """The parts a rank sends, in the order it sends them, each read while
    the one before is sent: on a thread of its own, with O_DIRECT
    (:meth:`FileIO.read_ranges`), into two buffers used in turn, so a
    part's bytes stay valid until the part after it is taken."""

    def __init__(self, io: FileIO | None, parts: list[tuple[str, list[tuple[int, int]]]]) -> None:
        self.io, self.parts, self.next = io, parts, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-restore-read") if parts else None
        self.pending = self._start(0)

    def _start(self, k: int) -> concurrent.futures.Future | None:
        if k >= len(self.parts):
            return None
        assert self.pool is not None and self.io is not None
        path, ranges = self.parts[k]
        return self.pool.submit(self.io.read_ranges, path, ranges, f"send{k % 2}")

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


def _source_key(tier: str, src: int, topology: Topology) -> str:
    """A source as failures name it: a file bad on a node is bad for every
    rank of that node (they share its local directory)."""
    if tier == "persistent":
        return "the persistent tier"
    return f"node {topology.node_of(src)}'s local tier"


def _link_or_copy(src: str, dst: str) -> None:
    """``src`` (a scanned regular file of the local tier) at ``dst``: a hard
    link, else a copy; both directories held open (no link followed in
    them), the file itself never followed (a link swapped in since the scan
    is linked as a link, which the load then refuses; copied, refused)."""
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
