"""``FastPersistSavePlanner``: DCP's ``DefaultSavePlanner`` with the same
plans and ``Metadata``, made faster.

What changes is only how: a flat state dict is not walked
(:mod:`fp_dcp.planners._flat`); a plain tensor's ``WriteItem`` is built
directly, sharing one ``TensorProperties`` per kind of tensor
(:mod:`fp_dcp.planners._items`: smaller plans to gather, too); the
coordinator plans from the gathered plans' columns without making their
items (:mod:`fp_dcp.planners._columns`), or over the items where the
columns cannot decide (:mod:`fp_dcp.planners._global`).  DTensors, ShardedTensors and tensor
subclasses go through DCP's own per-item code.  DCP's plan caching
(``enable_plan_caching=True``) works as with the default planner.

Where the installed torch lacks a piece this relies on, that step runs
DCP's own code (:data:`CAPABILITIES` says which).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from fp_dcp import _stateful
from fp_dcp.planners import _columns, _compact, _flat, _global, _items

__all__ = ["FastPersistSavePlanner", "local_save_items", "CAPABILITIES"]

logger = logging.getLogger(__name__)


def _capabilities() -> dict[str, bool]:
    from torch.distributed.checkpoint import default_planner, planner_helpers

    caching = all(hasattr(SavePlanner, a) for a in ("_cached_save_plan", "_cached_all_plans",
                                                    "_cached_global_plan", "_cached_metadata"))
    return {
        "items": _items.FAST,
        # DefaultSavePlanner.create_local_plan's caching protocol, reproduced here
        "local_plan": hasattr(planner_helpers, "_compare_save_plans") and caching
        and hasattr(planner_helpers, "_create_write_items"),
        # the step DefaultSavePlanner.create_global_plan delegates to
        "global_plan": hasattr(DefaultSavePlanner, "_create_global_plan")
        and hasattr(default_planner, "_validate_global_plan"),
    }


CAPABILITIES = _capabilities()
# where the local plan waits for the save to succeed before it is cached: a
# torch whose finish_plan promotes it from _pending_local_plan, else (older
# releases) create_local_plan caches it at once
_PENDING_LOCAL_PLAN = "_pending_local_plan" in DefaultSavePlanner.finish_plan.__code__.co_names
_TENSOR, _BYTE_IO, _SHARD = WriteItemType.TENSOR, WriteItemType.BYTE_IO, WriteItemType.SHARD
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_OBJECTS = frozenset({int, float, bool, str, bytes, type(None)})


def local_save_items(state_dict: dict[str, Any]) -> list:
    """``create_default_local_save_plan(state_dict, ...).items``."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.tensor import DTensor

    index, chunk, write_item, tensor_data = _items.index, _items.chunk, _items.write_item, _items.tensor_data
    zeros, props = _items.zeros, _items.properties
    items: list = []
    append = items.append
    boxes: dict = {}  # (global shape, mesh, placements) -> the shard's (offsets, sizes, global size)
    for fqn, obj in state_dict.items():
        t = type(obj)
        if t in _PLAIN_TENSORS:
            size = obj.size()
            z = zeros(len(size))
            append(write_item(index(fqn, z, None), _TENSOR, tensor_data(chunk(z, size), props(obj), size)))
        elif t in _OBJECTS:
            append(write_item(index(fqn, None, None), _BYTE_IO, None))
        elif t is DTensor:
            mesh = obj.device_mesh
            if mesh.get_coordinate() is None:
                continue
            # A shard's box depends on the global shape, the mesh and the
            # placements only: DCP computes it once per kind of DTensor here.
            key = (obj.shape, mesh, obj.placements)
            box = boxes.get(key)
            local = obj.to_local()
            if box is not None and type(local) in _PLAIN_TENSORS:
                off, sizes, size = box
                append(write_item(index(fqn, off, None), _SHARD, tensor_data(chunk(off, sizes), props(local), size)))
                continue
            made = _create_write_items(fqn, obj)
            items += made
            if len(made) == 1 and type(local) in _PLAIN_TENSORS and made[0].type == _SHARD:
                td = made[0].tensor_data
                assert td is not None  # a SHARD item carries its tensor data
                boxes[key] = (td.chunk.offsets, td.chunk.sizes, td.size)
        elif isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is not None:
                items += _create_write_items(fqn, obj)
        else:
            items += _create_write_items(fqn, obj)
    return items


class FastPersistSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner``, faster: the same plans and ``Metadata``
    for any state dict, storage and world size.  Same arguments.

        dcp.save(state_dict, storage_writer=..., planner=FastPersistSavePlanner())
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _stateful.install()  # dcp.save's state-dict copy and dcp.load's Stateful check, faster

    @_items.paused
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = _flat.flat_or_none(state_dict) if self.flatten_state_dict and self.flatten_sharded_tensors else None
        if flat is None:
            return super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict, self.mappings = flat
        self.is_coordinator = is_coordinator

    @_items.paused
    def create_local_plan(self) -> SavePlan:
        if not CAPABILITIES["local_plan"]:
            return super().create_local_plan()
        from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

        items = _compact.WriteItems(local_save_items(self.state_dict))
        items.lazy = True  # gathered as columns, planned from them
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=_compact.FlatMappings(self.mappings))
        self.plan = plan
        if self._enable_plan_caching:
            key = self._cached_plans_key
            cached = SavePlanner._cached_save_plan.get(key)
            if cached is not None and _compare_save_plans(plan, cached):
                logger.info("No change in the local plan. Skipping sending the plan to the coordinator")
                return SavePlan([], usable=False)
            if _PENDING_LOCAL_PLAN:
                self._pending_local_plan = plan  # promoted to the cache by finish_plan
            else:
                SavePlanner._cached_save_plan[key] = plan
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return _global.dedup(all_plans, self.dedup_save_to_lowest_rank)

    @_items.paused
    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not CAPABILITIES["global_plan"]:
            return super()._create_global_plan(all_plans)
        planned = _columns.plan(all_plans, self.dedup_save_to_lowest_rank)
        if planned is None:
            global_plan, metadata = _global.global_plan(self._dedup_save_plans(all_plans))
        else:
            global_plan, metadata, state = planned
        if self.flatten_state_dict:
            merged = _compact.merged([p.planner_data for p in global_plan])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if planned is None:
            errors = _global.validate(global_plan, metadata)
        else:
            errors = _global.validate(global_plan, metadata, _columns.suspects(state, len(all_plans)))
        if errors == [None]:  # as a torch whose check has no text says it
            raise ValueError("Failed to validate global plan")
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata
