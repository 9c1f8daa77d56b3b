"""The coordinator's share of a save's planning, as DCP's default planner does
it, without its per-item overheads.

* :func:`dedup` = ``dedup_save_plans``: an item on several ranks stays with
  the rank that has planned the fewest bytes so far (or the lowest rank),
  visiting the items in the order DCP visits them and breaking ties the way
  its ``min`` over a ``set`` does.  Items on one rank only (every shard of
  an FSDP model) are not walked at all when no item is replicated.
* :func:`global_plan` = ``create_default_global_save_plan``: the same
  ``Metadata`` (the same chunk objects, in the same order) and the same
  index hints.
* :func:`validate` = ``_validate_global_plan``: bounds, overlaps and volumes
  checked over numpy columns of every chunk at once; where that cannot
  decide (chunks not separable along one dimension), per tensor by
  :func:`fp_dcp.coverage.overlap`, and DCP's own sweep runs for a tensor
  only where that finds an overlap (or a chunk is empty); where anything
  is wrong DCP's own validation runs on the whole plan, so the errors and
  their text are DCP's.

Anything unusual (an item without tensor data, a repeated key) is handed to
DCP's own function, which raises its own error.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from fp_dcp import coverage
from fp_dcp.planners import _compact, _items

__all__ = ["dedup", "global_plan", "validate"]

_SHARD, _BYTE_IO = WriteItemType.SHARD, WriteItemType.BYTE_IO


def _storage_size(item: WriteItem) -> int:
    """``item.tensor_storage_size() or 1`` (DCP's dedup weight)."""
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.size) * td.properties.dtype.itemsize or 1


def dedup(all_plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """``dedup_save_plans(all_plans, save_to_lowest_rank)``."""
    owner: dict[tuple, int] = {}
    reps: dict[tuple, list[int]] = {}
    for p, plan in enumerate(all_plans):
        setdefault = owner.setdefault
        for it in plan.items:
            ix = it.index
            k = (ix.fqn, ix.offset)
            o = setdefault(k, p)
            if o != p:
                ranks = reps.get(k)
                if ranks is None:
                    reps[k] = [o, p]
                elif ranks[-1] != p:
                    ranks.append(p)
    if not reps:
        return [dataclasses.replace(plan, items=list(plan.items)) for plan in all_plans]

    last: dict[tuple, WriteItem] = {}
    for plan in all_plans:
        for it in plan.items:
            last[(it.index.fqn, it.index.offset)] = it
    keys = list(owner)  # DCP's visiting order: first seen
    weights = np.fromiter((_storage_size(last[k]) for k in keys), dtype=np.int64, count=len(keys))
    owners = np.fromiter(owner.values(), dtype=np.int64, count=len(keys))
    rep_pos = [i for i, k in enumerate(keys) if k in reps]
    plan_size = [0] * len(all_plans)
    removed: list[set[tuple]] = [set() for _ in all_plans]
    start = 0
    for i in rep_pos:
        if i > start:  # the single-rank items visited before this one
            acc = np.zeros(len(all_plans), dtype=np.int64)
            np.add.at(acc, owners[start:i], weights[start:i])
            for p in np.flatnonzero(acc).tolist():
                plan_size[p] += int(acc[p])
        k = keys[i]
        cands = set(reps[k])  # built in rank order, as DCP's set: same iteration order
        sel = min(cands) if save_to_lowest_rank else min(cands, key=plan_size.__getitem__)
        plan_size[sel] += int(weights[i])
        for p in cands:
            if p != sel:
                removed[p].add(k)
        start = i + 1
    out = []
    for plan, gone in zip(all_plans, removed):
        if gone:
            items = [it for it in plan.items if (it.index.fqn, it.index.offset) not in gone]
        else:
            items = list(plan.items)
        out.append(dataclasses.replace(plan, items=items))
    return out


def global_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """``create_default_global_save_plan(all_plans)``."""
    md: dict[str, Any] = {}
    new_plans = []
    hint = _items.with_index_hint
    for plan in all_plans:
        new_items = _compact.WriteItems()  # scattered as columns
        append = new_items.append
        for item in plan.items:
            kind = item.type
            fqn = item.index.fqn
            if kind != _SHARD and fqn in md:
                return _dcp_global_plan(all_plans)
            if kind == _BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                append(item)
                continue
            td = item.tensor_data
            if td is None or td.chunk is None:
                return _dcp_global_plan(all_plans)
            tmd = md.get(fqn)
            if tmd is None:
                tmd = md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
            elif type(tmd) is not TensorStorageMetadata:
                return _dcp_global_plan(all_plans)
            chunks = tmd.chunks
            append(hint(item, len(chunks)))
            chunks.append(td.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def _dcp_global_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    return create_default_global_save_plan(all_plans)


def _suspects(metadata: Metadata, n_plans: int) -> tuple[bool, list[str]]:
    """(whether something is certainly wrong, keys whose chunks need DCP's
    overlap sweep)."""
    by_ndim: dict[int, tuple[list, list, list, list, list]] = {}
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata):
            continue
        size = value.size
        nd = len(size)
        if nd == 0:
            continue
        chunks = value.chunks
        cols = by_ndim.get(nd)
        if cols is None:
            cols = by_ndim[nd] = ([], [], [], [], [])
        cols[0].append(key)
        cols[1].append(size)
        cols[2].append(len(chunks))
        cols[3].extend([c.offsets for c in chunks])
        cols[4].extend([c.sizes for c in chunks])
    flat = itertools.chain.from_iterable
    suspects: list[str] = []
    for nd, (keys, sizes, n_chunks, offs, lens) in by_ndim.items():
        counts = np.array(n_chunks, dtype=np.int64)
        if not len(offs):
            if n_plans > 1 and any(math.prod(s) != 0 for s in sizes):
                return True, []
            continue
        if set(map(len, offs)) != {nd} or set(map(len, lens)) != {nd}:
            return True, []  # a chunk with more or fewer dimensions than its tensor: DCP's checks decide
        try:
            shape = np.fromiter(flat(sizes), dtype=np.int64, count=len(keys) * nd).reshape(len(keys), nd)
            off = np.fromiter(flat(offs), dtype=np.int64, count=len(offs) * nd).reshape(-1, nd)
            ln = np.fromiter(flat(lens), dtype=np.int64, count=len(lens) * nd).reshape(-1, nd)
        except (ValueError, TypeError, OverflowError):  # not int64 numbers: DCP's checks decide
            return True, []
        kid = np.repeat(np.arange(len(keys)), counts)
        end = off + ln
        if (off < 0).any() or (ln < 0).any() or (end > shape[kid]).any():
            return True, []
        if n_plans > 1:
            volume = np.zeros(len(keys), dtype=np.int64)
            np.add.at(volume, kid, np.prod(ln, axis=1))
            if (volume != np.prod(shape, axis=1)).any():
                return True, []
        multi = counts > 1
        if multi.any():
            sep = coverage.separated(kid, list(off.T), list(end.T), multi)
            suspects.extend(keys[i] for i in np.flatnonzero(multi & ~sep).tolist())
    return False, suspects


def _may_overlap(value: Any) -> bool:
    """Whether DCP's sweep may find two of a tensor's chunks overlapping: its
    chunks on a grid or swept without comparing every pair
    (:func:`fp_dcp.coverage.overlap`: the sweep DCP runs compares the chunks
    that share a band of the tensor's largest dimension, a 2-d mesh's whole
    row of shards); an empty chunk is left to DCP's own test, which may find
    it overlapping where it holds nothing; so is a layout too costly to
    sweep here."""
    chunks = [(c.offsets, c.sizes) for c in value.chunks]
    try:
        return any(0 in n for _, n in chunks) or coverage.overlap(chunks)
    except coverage.CheckTooLarge:
        return True  # DCP's sweep decides, as it would without fp_dcp's planner


def validate(all_plans: list[SavePlan], metadata: Metadata,
             found: tuple[bool, list[str]] | None = None) -> list[str]:
    """``_validate_global_plan(all_plans, metadata)``: the list of errors
    (empty: valid).  ``found``: the checks' outcome, already made from the
    plans' columns."""
    from torch.distributed.checkpoint.default_planner import _validate_global_plan

    wrong, suspects = found if found is not None else _suspects(metadata, len(all_plans))
    suspects = [k for k in suspects if _may_overlap(metadata.state_dict_metadata[k])]
    if not wrong and suspects:
        sub = Metadata({k: metadata.state_dict_metadata[k] for k in suspects})
        wrong = bool(_errors(_validate_global_plan(all_plans, sub)))
    return _errors(_validate_global_plan(all_plans, metadata)) if wrong else []


def _errors(found: Any) -> list:
    """DCP's answer as a list of errors: a torch whose check answers only
    valid (True) or not gives ``[None]`` for not (no text)."""
    if isinstance(found, bool):
        return [] if found else [None]
    return found
