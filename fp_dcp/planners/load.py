"""``FastPersistLoadPlanner``: DCP's ``DefaultLoadPlanner`` with the same
read items, made faster.

A flat state dict is not walked (:mod:`fp_dcp.planners._flat`), and a plain
tensor whose checkpoint entry is one whole chunk (every tensor a single
process saved, every replicated one) gets its ``ReadItem`` built directly
instead of through DCP's resharding sweep.  DTensors, ShardedTensors,
tensors stored in several chunks and anything else go through DCP's own
per-item code.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from fp_dcp import _stateful
from fp_dcp.planners import _compact, _flat, _items

__all__ = ["FastPersistLoadPlanner", "local_read_items", "CAPABILITIES"]


def _capabilities() -> dict[str, bool]:
    from torch.distributed.checkpoint import planner_helpers

    return {"items": _items.FAST, "local_plan": hasattr(planner_helpers, "_create_read_items")}


CAPABILITIES = _capabilities()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_TENSOR, _BYTE_IO = LoadItemType.TENSOR, LoadItemType.BYTE_IO


def local_read_items(state_dict: dict[str, Any], metadata: Metadata, strict: bool = True) -> list:
    """``create_default_local_load_plan(state_dict, metadata, strict).items``."""
    from torch.distributed.checkpoint.planner_helpers import _create_read_items
    from torch.distributed.tensor import DTensor

    index, read_item, zeros = _items.index, _items.read_item, _items.zeros
    sdm = metadata.state_dict_metadata
    zero1 = torch.Size((0,))  # a bytes item's offsets and length
    items: list = []
    append = items.append
    for fqn, obj in state_dict.items():
        md = sdm.get(fqn)
        if md is None:
            if fqn in sdm:  # an entry that is None: DCP's own code says what is wrong
                items += _create_read_items(fqn, cast(Any, md), obj)
                continue
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if type(md) is BytesStorageMetadata and not isinstance(obj, DTensor):
            append(read_item(_BYTE_IO, index(fqn, None, None), zero1, index(fqn, None, None), zero1, zero1))
            continue
        if type(md) is TensorStorageMetadata and type(obj) in _PLAIN_TENSORS and len(md.chunks) == 1:
            c = md.chunks[0]
            size = md.size
            z = zeros(len(size))
            if c.offsets == z and c.sizes == size:
                if 0 in size:  # DCP's overlap test finds nothing to read in an empty tensor
                    continue
                append(read_item(_TENSOR, index(fqn, z, 0), z, index(fqn, c.offsets, 0), z, size))
                continue
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        items += _create_read_items(fqn, md, obj)
    return items


class FastPersistLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, faster: the same read items for any
    state dict and checkpoint.  Same arguments.

        dcp.load(state_dict, storage_reader=..., planner=FastPersistLoadPlanner())
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _stateful.install()  # dcp.save's state-dict copy and dcp.load's Stateful check, faster

    @_items.paused
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = (_flat.flat_or_none(state_dict, loading=True)
                if self.flatten_state_dict and self.flatten_sharded_tensors else None)
        if flat is None:
            return super().set_up_planner(state_dict, metadata, is_coordinator)
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flat
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    @_items.paused
    def create_local_plan(self) -> LoadPlan:
        if not all(CAPABILITIES.values()) or self.metadata is None or not self.flatten_state_dict:
            return super().create_local_plan()
        if set(self.metadata.state_dict_metadata) - set(self.state_dict):
            # missing keys: maybe a checkpoint from before torch 2.4, which
            # DCP's planner recognises (and flattens the old way)
            return super().create_local_plan()
        items = local_read_items(self.state_dict, self.metadata, not self.allow_partial_load)
        return LoadPlan(_compact.ReadItems(items))  # gathered and scattered as columns
