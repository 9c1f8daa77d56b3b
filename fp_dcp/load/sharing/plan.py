"""The coordinator's plan of shared reads (boxes read once, their owners, the
rounds), sent to every rank in its ``LoadPlan.storage_data`` so every rank
runs the same collectives.  Pure."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fp_dcp import format as fmt
from fp_dcp.load.jobs import MERGE_RUN_MAX_BYTES
from fp_dcp.load.plan import assign_owners, interleaved_slabs, split_box

__all__ = ["Part", "SharedUnit", "MachineInfo", "SharePlan", "plan_sharing", "read_key", "READ_AHEAD"]

# Rounds read from disk ahead of the one being exchanged: two keep the disk
# busy while one engine call drains its last requests (one engine each).  A
# round is sized to 1 / (READ_AHEAD + 2) of the buffer budget: the round being
# exchanged, the one before it (still on the wire, or being pulled from) and
# the READ_AHEAD rounds being read.
READ_AHEAD = 2


@dataclasses.dataclass(frozen=True)
class Part:
    """The sub-box (``offsets``/``lengths``, chunk coordinates) of a shared
    unit that ``rank`` needs for its read item of the box
    ``item_offsets``/``item_lengths`` of the same stored chunk."""

    rank: int
    item_offsets: tuple[int, ...]
    item_lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SharedUnit:
    """A box (``offsets``/``lengths``) of a stored chunk that ``owner`` reads
    from disk, and the ``parts`` of it that ranks need: the owner keeps its
    own and sends the others.  Replicated reads: every part is the whole box.
    Interleaved reads: the box is a row slab and each part a column band."""

    fqn: str
    chunk: tuple[int, ...] | None
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    owner: int
    parts: tuple[Part, ...]

    def item_key(self, part: Part) -> tuple:
        return (self.fqn, self.chunk, part.item_offsets, part.item_lengths)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(p.rank for p in self.parts))


@dataclasses.dataclass(frozen=True)
class MachineInfo:
    """What a rank's local plan tells the coordinator (``storage_data``):
    the machine it runs on (:func:`fp_dcp.load.sharing.transport.machine_id`)."""

    machine: int


@dataclasses.dataclass
class SharePlan:
    """``LoadPlan.storage_data`` when reads are shared: the same list on every
    rank (the collectives follow it); ``rounds`` are ranges of ``units``;
    ``transport`` the coordinator's ``shared_read_transport``."""

    units: list[SharedUnit]
    rounds: list[tuple[int, int]]
    transport: str = "process_group"


def read_key(req: ReadItem) -> tuple:
    """What identifies a read item's box: (fqn, chunk, offsets, lengths)."""
    idx = req.storage_index
    return (idx.fqn, None if idx.offset is None else tuple(idx.offset),
            tuple(req.storage_offsets), tuple(req.lengths))


def plan_sharing(plans: list[LoadPlan], state_dict_metadata: dict[str, Any],
                 chunk_sizes: Callable[[str, Any], tuple[list[int], Any]], *, budget: int, interleave: bool,
                 interleave_auto: bool, replicate: bool, transport: str) -> SharePlan | None:
    """The shared units of the load, each with one owner, in rounds bounded by
    ``budget``; None when nothing is shared.  ``interleave`` / ``replicate``:
    which kinds of units to make."""
    # Owners: the rank with the most of its quota left (assign_owners), its
    # quota being its share of the shared bytes in proportion to what it needs
    # of them, so each rank reads about what it needs.
    machines = [p.storage_data.machine if isinstance(p.storage_data, MachineInfo) else None for p in plans]
    by_chunk: dict[tuple, dict[tuple, None]] = {}
    for rank, plan in enumerate(plans):
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                continue
            fqn, chunk, offsets, lengths = read_key(req)
            by_chunk.setdefault((fqn, chunk), {})[(rank, offsets, lengths)] = None
    # (fqn, chunk, offsets, lengths, nbytes, parts) before owners are chosen
    pending: list[tuple] = []
    for fqn, chunk in sorted(by_chunk, key=lambda k: (k[0], k[1] or ())):
        md = state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        esize = md.properties.dtype.itemsize
        boxes = list(by_chunk[(fqn, chunk)])
        rest = boxes
        if interleave:
            try:
                sizes, _ = chunk_sizes(fqn, None if chunk is None else list(chunk))
            except fmt.CheckpointFormatError:
                sizes = None  # the ranks' own reads report it
            slabs = [] if sizes is None else interleaved_slabs(
                sizes, esize, boxes, max(1, budget // 16), run_max_bytes=MERGE_RUN_MAX_BYTES)
            if interleave_auto and not all(
                    len(ms := {machines[boxes[i][0]] for i, _, _ in sl.parts}) == 1 and None not in ms
                    for sl in slabs):
                # auto: a part would cross machines (or a rank did not
                # say where it runs), and the process group's network may
                # be slower than reading the runs: each rank reads its own
                slabs = []
            for sl in slabs:
                parts = tuple(Part(boxes[i][0], boxes[i][1], boxes[i][2], tuple(o), tuple(n))
                              for i, o, n in sl.parts)
                pending.append((fqn, chunk, sl.offsets, sl.lengths, sl.nbytes, parts))
            if slabs:
                rest = []
        if replicate:
            needers: dict[tuple, list[int]] = {}
            for rank, offsets, lengths in rest:
                needers.setdefault((offsets, lengths), []).append(rank)
            for (offsets, lengths), ranks in sorted(needers.items()):
                if len(ranks) < 2:
                    continue
                for sub_off, sub_len in split_box(lengths, esize, max(1 << 20, budget // 8)):
                    offs = tuple(o + s for o, s in zip(offsets, sub_off))
                    lens = tuple(sub_len)
                    parts = tuple(Part(r, offsets, lengths, offs, lens) for r in ranks)
                    pending.append((fqn, chunk, offs, lens, math.prod(lens) * esize, parts))
    if not pending:
        return None
    esizes = {fqn: state_dict_metadata[fqn].properties.dtype.itemsize for fqn, *_ in pending}
    need = [0] * len(plans)
    for fqn, _, _, _, _, parts in pending:
        for p in parts:
            need[p.rank] += math.prod(p.lengths) * esizes[fqn]
    total = sum(u[4] for u in pending)
    quota = {r: n * total // max(1, sum(need)) for r, n in enumerate(need)}
    owners = assign_owners([(u[4], [p.rank for p in u[5]]) for u in pending], quota)
    units = [SharedUnit(fqn, chunk, offs, lens, nbytes, owner, parts)
             for (fqn, chunk, offs, lens, nbytes, parts), owner in zip(pending, owners)]
    # A round holds, per rank, at most the boxes it reads (a temporary),
    # the parts it sends (packed) and those it receives (when they cannot
    # land in their targets), within 1 / (READ_AHEAD + 2) of the budget.
    rounds, start = [], 0
    held = [0] * len(plans)
    for i, u in enumerate(units):
        add = [0] * len(plans)
        add[u.owner] += u.nbytes
        for p in u.parts:
            if p.rank != u.owner:
                nbytes = math.prod(p.lengths) * esizes[u.fqn]
                add[p.rank] += nbytes
                add[u.owner] += nbytes
        if i > start and any(h + a > budget // (READ_AHEAD + 2) for h, a in zip(held, add)):
            rounds.append((start, i))
            start, held = i, [0] * len(plans)
        held = [h + a for h, a in zip(held, add)]
    rounds.append((start, len(units)))
    return SharePlan(units, rounds, transport)
