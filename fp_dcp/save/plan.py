"""The save plan: :class:`RankHoldings` (each rank to the coordinator),
:class:`Assignment` (the coordinator to each rank), and the records behind
DCP's plan caching (docs/ARCHITECTURE.md, "DCP's plan caching")."""

from __future__ import annotations

import collections
import dataclasses
import math
import secrets
import time
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from fp_dcp.save import balance

__all__ = [
    "PLACEMENTS",
    "RankHoldings",
    "Assignment",
    "GlobalRecord",
    "describe_rank",
    "assign",
    "keep_global_record",
    "assignment_items",
    "clear_plan_records",
    "item_name",
    "expected_nbytes",
]

# Placements by structure (balance.structure_key), shared by the writers of
# this process: a training loop that builds a new writer for each save still
# plans once.  Eight: a job alternates between a few structures (a full save,
# a model-only one, ...), each placement is a few arrays per rank.
PLACEMENTS = balance.PlanCache(capacity=8)

# How many ranks' item lists this process keeps for DCP's plan caching: a
# cached plan may refer to any state-dict structure this process saved
# through a caching planner, so this bounds how many such structures a job
# can alternate between (the lists hold DCP's WriteItems, not tensors).  The
# lists that a planner's cache still stands for are never dropped.
LOCAL_ITEMS_CAPACITY = 16

_local_items: "collections.OrderedDict[str, list[WriteItem]]" = collections.OrderedDict()
_rank_last: dict[tuple[int, str], "Assignment"] = {}  # (rank, planner class) -> last assignment written


@dataclasses.dataclass(frozen=True)
class RankHoldings:
    """What ``prepare_local_plan`` tells the coordinator: every item this
    rank holds (``holdings``: keys and byte sizes, in plan order) and its
    host and number of data directories."""

    rank: int
    host: str
    holdings: balance.Holdings | None = None
    token: str = ""  # key of these items in this rank's process records


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What ``prepare_global_plan`` hands each rank: its pieces (byte ranges
    of items it holds, by position in its ``prepare_local_plan`` items, and
    the data directory of each), under this save's ``save_id``."""

    save_id: str
    rank: int
    pieces: balance.RankPieces | None = None
    n_items: int = 0
    plan_key: str = ""
    token: str = ""  # the rank's RankHoldings.token these pieces index
    reuse: bool = False  # DCP cached everything: write with this rank's last assignment (save_id aside)
    recycle: str = ""  # a retired checkpoint's data file to write over instead of a new file (save.recycle)


@dataclasses.dataclass
class GlobalRecord:
    infos: list[RankHoldings]  # by rank
    key: str
    placement: Any


_last_global: dict[int, GlobalRecord] = {}  # world size -> record of the last save through a caching planner


def item_name(item: WriteItem) -> str:
    """An item's name in messages: its key, and a shard's offset."""
    if item.index.offset is not None and item.type == WriteItemType.SHARD:
        return f"{item.index.fqn} (shard at {list(item.index.offset)})"
    return item.index.fqn


def expected_nbytes(item: WriteItem) -> int | None:
    """A tensor item's size in bytes as planned (None: a bytes item)."""
    td = item.tensor_data
    if td is None:
        return None
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def describe_rank(
    rank: int, host: str, items: list[WriteItem], n_dirs: int, granularity: int, small_bytes: int
) -> RankHoldings:
    """Record this rank's ``items`` (its usable local plan's) in this
    process, and describe them for the coordinator."""
    token = _remember_local_items(items)
    sizes = []
    for item in items:
        n = None if item.type == WriteItemType.BYTE_IO else expected_nbytes(item)
        sizes.append(balance.UNSIZED if n is None else n)
    holdings = balance.make_holdings(
        rank,
        host,
        balance.item_keys((it.index.fqn, it.index.offset) for it in items),
        sizes,
        n_dirs=n_dirs,
        granularity=granularity,
        small_bytes=small_bytes,
    )
    return RankHoldings(rank, host, holdings, token)


def _remember_local_items(items: list[WriteItem]) -> str:
    token = secrets.token_hex(8)
    _local_items[token] = items
    if len(_local_items) > LOCAL_ITEMS_CAPACITY:
        # the oldest first, but never those a planner's cache still stands for
        pinned = {a.token for a in _rank_last.values()} | {token}
        for old in [t for t in _local_items if t not in pinned][: len(_local_items) - LOCAL_ITEMS_CAPACITY]:
            del _local_items[old]
    return token


def assign(
    save_id: str, infos: list[RankHoldings | None]
) -> tuple[list[Assignment], GlobalRecord | None, dict[str, Any]]:
    """The coordinator's plan: one assignment per rank, from each rank's
    ``RankHoldings`` (``infos``, by rank; None where DCP sent a cached,
    empty plan), the record to keep if the planner caches plans (None when
    DCP cached everything), and a summary of the placement."""
    t0 = time.perf_counter()
    if all(info is None for info in infos):
        # DCP cached everything: each rank writes with its last
        # assignment for this planner; only the save_id is new.
        summary: dict[str, Any] = {
            "cached": True, "dcp_cached": True, "seconds": time.perf_counter() - t0, "ranks": len(infos)
        }
        return [Assignment(save_id, rank, reuse=True) for rank in range(len(infos))], None, summary
    record = _last_global.get(len(infos))
    known: list[RankHoldings] = []
    for rank, info in enumerate(infos):
        if info is None:
            # DCP's plan caching: nothing changed on this rank since the
            # last save through this planner; its items are the last ones
            # this process saw from it.
            if record is None:
                raise RuntimeError(
                    f"FastPersistWriter.prepare_global_plan: DCP's plan caching sent a cached (empty) plan for "
                    f"rank {rank}, but no earlier save of this process went through a FastPersistWriter with "
                    f"{len(infos)} rank(s) (was the planner's cache filled by a save through another storage "
                    f"writer?); save once with a planner without plan caching, or clear SavePlanner's caches"
                )
            known.append(record.infos[rank])
            continue
        known.append(info)
    holdings = [info.holdings for info in known if info.holdings is not None]
    assert len(holdings) == len(known)  # prepare_global_plan passes only plans with holdings
    key = balance.structure_key(holdings)
    placement = PLACEMENTS.get(key)
    cached = placement is not None
    if placement is None:
        placement = balance.plan_placement(holdings)
        PLACEMENTS.put(key, placement)
    summary = {
        "cached": cached,
        "dcp_cached": False,
        "seconds": time.perf_counter() - t0,
        "ranks": len(infos),
        "items": placement.items,
        "bytes": placement.total_bytes,
        "balance": placement.balance(),
        "rank_bytes": placement.loads.tolist(),
        "device_bytes": {h: v.tolist() for h, v in placement.device_loads.items()},
    }
    assignments = [
        Assignment(save_id, rank, placement.pieces[rank], len(h.keys), key, info.token)
        for rank, (info, h) in enumerate(zip(known, holdings))
    ]
    return assignments, GlobalRecord(known, key, placement), summary


def keep_global_record(record: GlobalRecord) -> None:
    """Keep the coordinator's record of a save through a caching planner:
    the next save's cached (empty) plans are planned with it."""
    _last_global[len(record.infos)] = record


def assignment_items(
    assignment: Assignment, rank: int, planner_key: str | None, save_token: str | None
) -> tuple[Assignment, list[WriteItem]]:
    """This save's assignment and the items its pieces index (recorded under
    ``assignment.token``, or with ``reuse`` this rank's last assignment for the
    planner class ``planner_key``).  ``save_token``: this save's local items'
    token (None: DCP sent a cached plan)."""
    way_out = ("save once with a planner without plan caching (or clear SavePlanner's class-level "
               "caches)")
    if assignment.reuse:
        last = None if planner_key is None else _rank_last.get((rank, planner_key))
        if last is None:
            raise RuntimeError(
                f"rank {rank}: DCP's plan caching ({planner_key}) reports nothing changed since the "
                f"last save, but no earlier save of this process through that planner went through a "
                f"FastPersistWriter (the planner's cache was filled through another storage writer?); "
                + way_out
            )
        assignment = dataclasses.replace(last, save_id=assignment.save_id, reuse=False, recycle=assignment.recycle)
    items = _local_items.get(assignment.token)
    if items is None:
        raise RuntimeError(
            f"rank {rank}: the global plan refers to local items this process no longer holds "
            f"(DCP's plan caching across more than {LOCAL_ITEMS_CAPACITY} state-dict structures, or a "
            f"plan made in another process); " + way_out
        )
    # What this rank holds now: this save's items, or (DCP sent nothing
    # from it) those of its last save through this planner.
    last = None if planner_key is None else _rank_last.get((rank, planner_key))
    reference = save_token or (last.token if last is not None else None)
    if reference is not None and reference != assignment.token and reference in _local_items:
        # The coordinator planned with an older record of this rank (DCP
        # sent it no news: this rank's global items had not changed, or
        # another planner's save came between).  Every item it assigns
        # to this rank must still be here, same size.
        now = {
            balance.item_key(it.index.fqn, it.index.offset): expected_nbytes(it)
            for it in _local_items[reference]
        }
        assert assignment.pieces is not None  # every assignment but a reused one has pieces
        for li in set(assignment.pieces.local.tolist()):
            it = items[li]
            k = balance.item_key(it.index.fqn, it.index.offset)
            if k not in now or now[k] != expected_nbytes(it):
                raise RuntimeError(
                    f"rank {rank}: DCP's plan caching kept a global plan that assigns "
                    f"{item_name(it)} to this rank, which no longer holds it as planned; " + way_out
                )
    if planner_key is not None:
        _rank_last[(rank, planner_key)] = assignment
    return assignment, items


def clear_plan_records() -> None:
    """Forget the per-process records that serve DCP's plan caching (tests;
    or after ``SavePlanner``'s class-level caches were cleared)."""
    _local_items.clear()
    _rank_last.clear()
    _last_global.clear()
