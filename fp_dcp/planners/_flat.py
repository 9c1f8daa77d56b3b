"""The flat state dict DCP's planners make, without walking it when it is
already flat.

``DefaultSavePlanner`` / ``DefaultLoadPlanner`` run ``flatten_state_dict``
and ``_flatten_sharded_tensors`` over every state dict: a recursive walk with
several ``isinstance`` checks per value.  A value that is a plain tensor or
scalar under a string key is flat already: it stays as it is, and its key
maps to the path ``(key,)``.  The walk is per key, so the other values (nested
containers: a config dict, an optimizer's state) are walked by DCP's own
functions one key at a time, in order (on load, ``_flatten_sharded_tensors``
first, as DCP's load planner does).  :func:`flat_or_none`
returns the result, or None where DCP's whole walk is needed (DTensors,
ShardedTensors and other tensor subclasses anywhere, meta tensors on load,
keys that collide, a key that is not a string), and the caller then runs
DCP's own.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["flat_or_none"]

# Values DCP's walk keeps as they are: not a Mapping, not a list, not a
# ShardedTensor (exact types: a subclass may be any of those).
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, type(None)})
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _old_traversal() -> bool:
    """Whether DCP is reading a checkpoint saved before torch 2.4 (its
    flattening then follows the old rules)."""
    try:
        from torch.distributed.checkpoint import _version

        return getattr(_version, "_derived_version", None) is not None
    except ImportError:  # pragma: no cover
        return True


def flat_or_none(state_dict: Any, *, loading: bool = False) -> tuple[dict[str, Any], dict[str, tuple]] | None:
    """``(flat, mappings)`` as DCP's flattening makes them for ``state_dict``,
    or None (module documentation).  ``loading``: also None where a tensor is
    on the meta device (DCP's load materialises those first)."""
    if type(state_dict) is not dict or _old_traversal():
        return None
    leaf, tensors = _LEAF_TYPES, _TENSORS
    nested = False
    for k, v in state_dict.items():
        tv = type(v)
        if type(k) is not str:
            return None
        if tv not in leaf:
            nested = True
        elif loading and tv in tensors and v.is_meta:
            return None
    if not nested:
        return dict(state_dict), {k: (k,) for k in state_dict}
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    flat: dict[str, Any] = {}
    mappings: dict[str, tuple] = {}
    for k, v in state_dict.items():
        if type(v) in leaf:
            if k in flat:  # a nested path before flattened to this key
                return None
            flat[k] = v
            mappings[k] = (k,)
            continue
        # in DCP's order: a load rewrites the nested structure first (which
        # drops empty containers: [3, {}] becomes [3], one value, not "k.0")
        try:
            part, paths = flatten_state_dict(_flatten_sharded_tensors({k: v}) if loading else {k: v})
        except Exception:  # noqa: BLE001 - DCP's whole walk raises it, where DCP would
            return None
        for fk, fv in part.items():
            # a ShardedTensor or DTensor (which _flatten_sharded_tensors and the
            # load's _init_state_dict act on; any tensor subclass here), a meta
            # tensor on load or a key that collides: DCP's walk (and its error)
            if isinstance(fv, torch.Tensor) and (type(fv) not in tensors or loading and fv.is_meta) or fk in flat:
                return None
            flat[fk] = fv
            mappings[fk] = paths[fk]
    return flat, mappings
