"""The flat state dict DCP's planners make, without walking it when it is
already flat.

``DefaultSavePlanner`` / ``DefaultLoadPlanner`` run ``flatten_state_dict``
and ``_flatten_sharded_tensors`` over every state dict: a recursive walk with
several ``isinstance`` checks per value.  A state dict whose keys are
strings and whose values are plain tensors or scalars is already flat: the
result is a copy of it, and each key maps to the path ``(key,)``.
:func:`flat_or_none` returns that, or None where the walk is needed (nested
containers, DTensors and ShardedTensors, meta tensors on load, anything
else), and the caller then runs DCP's own.
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
    """``(flat, mappings)`` as DCP's flattening makes them for a flat
    ``state_dict``, or None.  ``loading``: also None where a tensor is on
    the meta device (DCP's load materialises those first)."""
    if type(state_dict) is not dict or _old_traversal():
        return None
    leaf, tensors = _LEAF_TYPES, _TENSORS
    for k, v in state_dict.items():
        tv = type(v)
        if type(k) is not str or tv not in leaf:
            return None
        if loading and tv in tensors and v.is_meta:
            return None
    return dict(state_dict), {k: (k,) for k in state_dict}
