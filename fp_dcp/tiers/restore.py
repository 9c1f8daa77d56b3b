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
   load, so any world size and sharding) and lists the data files its read
   items touch.
4. *Assembly.*  Each node gathers the files its ranks need into
   ``<local root>/.restore/``: a file its own local tier holds is checked
   and hard-linked; one held only by other nodes comes from one of them
   over the process group (:mod:`fp_dcp.tiers.replicate`); the persistent
   tier only for what no node holds.  Every file is checked against the
   metadata's checksums before it is taken; a file that fails is skipped
   (named in ``RestoreResult.skipped``) and fetched from the next source, in
   rounds that every rank runs alike.
5. *Load.*  The node's directory gets a metadata of the same save that
   names only the files assembled there (every item they hold whole), and
   ``dcp.load`` reads it through ``FastPersistReader`` — every check of a
   normal load applies (names of this save only, no links, checksums).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import zlib
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from fp_dcp import FastPersistOptions, FastPersistReader
from fp_dcp import format as fmt
from fp_dcp.files import read_metadata_bytes
from fp_dcp.tiers import integrity, store
from fp_dcp.tiers.replicate import Transfer, run_transfers
from fp_dcp.tiers.topology import Topology

__all__ = ["RestoreResult", "restore", "TierRestoreError"]

TIERS = ("local", "replica", "persistent")


class TierRestoreError(RuntimeError):
    """No tier holds a good copy of some file the restore needs."""


@dataclasses.dataclass
class RestoreResult:
    step: int
    save_id: str
    bytes_from: dict[str, int]  # this rank's bytes taken from each tier (local, replica, persistent)
    skipped: list[str]  # every rank's: file, source and why it was passed over
    seconds: float
    node_bytes_from: dict[str, int] = dataclasses.field(default_factory=dict)  # the whole job's
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds: agree, assemble, load


@dataclasses.dataclass(frozen=True)
class _Need:
    node: int
    name: str
    receiver: int


def _holding_doc(holdings: dict[int, store.Holding]) -> dict[int, Any]:
    return {s: (h.save_id, h.meta_files, h.files) for s, h in holdings.items()}


def _choose(step: int | None, invs: list[dict], pers: dict[int, Any]) -> tuple[int, str, list] | None:
    """The newest step complete somewhere: ``(step, save_id, files)``."""
    candidates: dict[tuple[int, str], list] = {}
    for inv in invs + [pers]:
        for s, (sid, meta_files, _) in inv.items():
            if sid is not None:
                candidates.setdefault((s, sid), meta_files)
    for (s, sid), files in sorted(candidates.items(), key=lambda kv: kv[0][0], reverse=True):
        if step is not None and s != step:
            continue
        # every file present at its recorded size in some tier
        ok = all(any(inv.get(s) and inv[s][2].get(n) == z for inv in invs + [pers]) for n, z in files)
        if ok:
            return s, sid, files
    return None


def _needed_files(state_dict: dict, metadata, layout: fmt.StorageLayout, planner, is_coordinator: bool) -> set[str]:
    planner.set_up_planner(state_dict, metadata, is_coordinator)
    plan = planner.create_local_plan()
    fids: set[int] = set()
    for item in plan.items:
        exts = layout.extents.get(MetadataIndex(item.storage_index.fqn, item.storage_index.offset))
        if exts is None:
            raise fmt.CheckpointFormatError(f"{item.storage_index.fqn}: the checkpoint has no extents for it")
        fids.update(e.file for e in exts)
    return {layout.files[f][0] for f in fids}


def subset_layout(layout: fmt.StorageLayout, names: set[str]) -> fmt.StorageLayout:
    """``layout`` with only the files ``names`` and the items they hold whole."""
    keep = [fid for fid, (n, _) in enumerate(layout.files) if n in names]
    new_id = {old: new for new, old in enumerate(keep)}
    extents = {
        idx: [dataclasses.replace(e, file=new_id[e.file]) for e in exts]
        for idx, exts in layout.extents.items()
        if all(e.file in new_id for e in exts)
    }
    return dataclasses.replace(layout, files=[layout.files[f] for f in keep], extents=extents)


def restore(state_dict: dict, *, rank: int, topology: Topology, local_root: str, persistent_root: str | None,
            group, bytes_group=None, planner=None, step: int | None = None,
            options: FastPersistOptions | None = None) -> RestoreResult | None:
    t0 = time.perf_counter()
    world = dist.get_world_size(group)
    node = topology.node_of(rank)
    leader = topology.leader(node) == rank
    restore_dir = os.path.join(local_root, store.RESTORE_DIR)
    if leader:
        shutil.rmtree(restore_dir, ignore_errors=True)
        os.makedirs(restore_dir)

    # 1. inventory
    mine = _holding_doc(store.scan(local_root))
    pers = {}
    if rank == 0 and persistent_root is not None:
        pers = {s: d for s, d in _holding_doc(store.scan(persistent_root)).items() if d[0] is not None}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (mine, pers), group=group)
    invs = [g[0] for g in gathered]
    pers = gathered[0][1]

    # 2. agreement
    chosen = _choose(step, invs, pers)
    if chosen is None:
        if step is not None:
            raise TierRestoreError(f"step {step} is complete in no tier (local, replicas, persistent)")
        return None
    s, save_id, files = chosen
    sizes = dict(files)
    phases = {"agree": time.perf_counter() - t0}

    def holds(r: int, name: str) -> bool:
        h = invs[r].get(s)
        return h is not None and h[2].get(name) == sizes[name]

    # 3. metadata to all, needs
    meta_src = next((r for r in range(world) if invs[r].get(s) and invs[r][s][0] == save_id), 0)
    box = [None]
    if rank == meta_src:
        ours = invs[rank].get(s) is not None and invs[rank][s][0] == save_id
        box = [read_metadata_bytes(store.step_dir(local_root if ours else persistent_root, s))]
    dist.broadcast_object_list(box, group_src=meta_src, group=group)
    blob = box[0]
    metadata, layout, extra = store.decode(blob, f"step {s} metadata (from rank {meta_src})")
    fid_of = {n: i for i, (n, _) in enumerate(layout.files)}
    load_planner = planner if planner is not None else DefaultLoadPlanner()
    needed = _needed_files(state_dict, metadata, layout, load_planner, rank == 0)
    all_needs: list = [None] * world
    dist.all_gather_object(all_needs, sorted(needed), group=group)
    needs: list[_Need] = []
    for n_idx, ranks in enumerate(topology.nodes):
        names = sorted({n for r in ranks for n in all_needs[r]})
        for name in names:
            needs.append(_Need(n_idx, name, min(r for r in ranks if name in all_needs[r])))

    # 4. assembly, in rounds
    bad: set[tuple[str, str]] = set()  # (file, source)
    skipped: list[str] = []
    taken = {t: 0 for t in TIERS}
    pending = needs
    local_dir = store.step_dir(local_root, s)
    pers_dir = None if persistent_root is None else store.step_dir(persistent_root, s)
    while pending:
        plan: list[tuple[_Need, str, int]] = []  # (need, tier, source rank)
        missing = []
        for need in pending:
            src = _pick(need, topology, world, holds, pers, s, sizes, bad)
            if src is None:
                missing.append(need)
            else:
                plan.append((need, *src))
        if missing:
            raise TierRestoreError(
                f"step {s}: no tier holds a good copy of "
                + ", ".join(sorted({m.name for m in missing}))
                + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
            )
        failures: list[tuple[str, str, str, int]] = []  # (file, source, why, receiver)
        for need, tier, src in plan:
            if need.receiver != rank or tier == "replica":
                continue
            fid = fid_of[need.name]
            from_dir = local_dir if tier == "local" else pers_dir
            try:
                dst = os.path.join(restore_dir, need.name)
                if tier == "local":
                    integrity.check_file(os.path.join(from_dir, need.name), layout, fid)
                    _link_or_copy(os.path.join(from_dir, need.name), dst)
                else:
                    integrity.copy_checked(os.path.join(from_dir, need.name), dst, layout, fid, sync=False)
                taken[tier] += sizes[need.name]
            except OSError as e:
                failures.append((need.name, _source_key(tier, src, topology), str(e), rank))

        transfers = [Transfer(src, need.receiver, need.name, sizes[need.name])
                     for need, tier, src in plan if tier == "replica"]

        def read(t: Transfer) -> Any:
            return integrity.read_file(os.path.join(local_dir, t.name), t.size)

        def receive(t: Transfer, data: Any) -> None:
            integrity.check_buffer(data, layout, fid_of[t.name], f"{t.name} from rank {t.src}")
            store.write_atomic(os.path.join(restore_dir, t.name), data, sync=False)
            taken["replica"] += t.size

        _, failed = run_transfers(transfers, rank, bytes_group or group, read, receive)
        for t, why in failed.items():
            if t.dst == rank:
                failures.append((t.name, _source_key("replica", t.src, topology), why, rank))
        every: list = [None] * world
        dist.all_gather_object(every, failures, group=group)
        flat = sorted({f for fs in every for f in fs})
        for name, source, why, receiver in flat:
            bad.add((name, source))
            skipped.append(f"{name} from {source}, for rank {receiver}: {why}")
        failed = {(receiver, name) for name, _, _, receiver in flat}
        pending = [need for need, _, _ in plan if (need.receiver, need.name) in failed]

    phases["assemble"] = time.perf_counter() - t0 - phases["agree"]
    # 5. the node's metadata, then the load
    if leader:
        mine_names = {need.name for need in needs if need.node == node}
        metadata.storage_data = sub = subset_layout(layout, mine_names)
        store.write_atomic(os.path.join(restore_dir, fmt.METADATA_NAME),
                           fmt.encode_metadata(metadata, sub, extra), sync=False)
    dist.barrier(group=group)
    # every rank reads only its node's files (no shared reads), and through
    # the page cache: the assembly just read (and checked) or wrote every one
    opts = (options or FastPersistOptions.from_env()).replace(
        share_replicated_reads=False, share_interleaved_reads=False, direct_io=False)
    t_load = time.perf_counter()
    dcp.load(state_dict, storage_reader=FastPersistReader(restore_dir, options=opts), planner=planner,
             process_group=group)
    dist.barrier(group=group)
    phases["load"] = time.perf_counter() - t_load
    if leader:
        shutil.rmtree(restore_dir, ignore_errors=True)
    totals: list = [None] * world
    dist.all_gather_object(totals, taken, group=group)
    job = {t: sum(x[t] for x in totals) for t in TIERS}
    return RestoreResult(s, save_id, taken, skipped, time.perf_counter() - t0, job, phases)


def _source_key(tier: str, src: int, topology: Topology) -> str:
    """A source as failures name it: a file bad on a node is bad for every
    rank of that node (they share its local directory)."""
    if tier == "persistent":
        return "the persistent tier"
    return f"node {topology.node_of(src)}'s local tier"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if isinstance(e, FileExistsError):
            raise
        shutil.copyfile(src, dst, follow_symlinks=False)


def _pick(need: _Need, topology: Topology, world: int, holds, pers: dict, s: int, sizes: dict,
          bad: set) -> tuple[str, int] | None:
    """The fastest good source of a file for a node: its own local tier, a
    replica on another node (spread over the holders by file name), the
    persistent tier."""
    if holds(need.receiver, need.name) and (need.name, _source_key("local", need.receiver, topology)) not in bad:
        return "local", need.receiver
    others = [r for r in range(world) if topology.node_of(r) != need.node and holds(r, need.name)
              and (need.name, _source_key("replica", r, topology)) not in bad]
    if others:
        return "replica", others[zlib.crc32(f"{need.node}/{need.name}".encode()) % len(others)]
    if pers.get(s) and pers[s][2].get(need.name) == sizes[need.name] \
            and (need.name, "the persistent tier") not in bad:
        return "persistent", -1
    return None
