"""Loading a checkpoint's objects (DCP's bytes items) without running its code.

DCP stores every non-tensor value of a state dict (a step counter, an LR
scheduler's or a data loader's state) as a *bytes item*: ``torch.save`` of
the object.  DCP's default load planner turns it back with
``torch.load(..., weights_only=False)``: a full unpickle, which runs whatever
callable the bytes name.  The metadata alone decides which keys are bytes
items, so a crafted checkpoint could run code through any key.

fp_dcp hands DCP's planner only objects that torch's restricted unpickler
(``torch.load(weights_only=True)``: tensors, ``torch.Size``, dtypes, plain
containers and scalars, and what ``torch.serialization.add_safe_globals``
allows) has rebuilt.  A payload that needs anything else is refused with
:class:`UnsafeObjectError`, naming the key, the globals it wants and the two
ways to accept it.  ``FastPersistOptions(allow_pickle=True)`` (environment
``FP_DCP_ALLOW_PICKLE=1``) restores the full unpickler, for checkpoints you
trust.

A bytes item is also never loaded over a tensor of the caller's state dict
(:func:`check_bytes_targets`): a checkpoint cannot swap a tensor for an
object.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from fp_dcp import format as fmt

__all__ = ["UnsafeObjectError", "load_object", "deliver_object", "put_object", "check_bytes_targets"]


class UnsafeObjectError(fmt.CheckpointFormatError):
    """A stored object needs a type that the restricted unpickler does not allow."""


def load_object(data: bytes, key: str, where: str, allow_pickle: bool) -> Any:
    """The object stored as ``data`` under ``key`` (``where`` names the
    checkpoint in errors), rebuilt by torch's restricted unpickler unless
    ``allow_pickle``."""
    try:
        return torch.load(io.BytesIO(data), weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            raise fmt.CheckpointFormatError(f"{where}: the object stored under {key!r} cannot be read: {e}") from None
        wanted = _unsafe_globals(data)
        named = ", ".join(wanted) if wanted else "a type or operation outside the allow-list"
        raise UnsafeObjectError(
            f"{where}: refusing to load the object stored under {key!r}: it needs {named}, which "
            f"torch's restricted unpickler (torch.load(weights_only=True)) does not allow, and loading "
            f"it would run code the checkpoint chooses. If you trust this checkpoint, allow the types "
            f"it needs with torch.serialization.add_safe_globals([...]) before loading, or load it "
            f"with FastPersistReader(path, allow_pickle=True) (environment FP_DCP_ALLOW_PICKLE=1), "
            f"which unpickles everything"
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure to decode is a damaged payload
        raise fmt.CheckpointFormatError(
            f"{where}: the object stored under {key!r} cannot be read ({type(e).__name__}: {e})"
        ) from None


def _unsafe_globals(data: bytes) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - a payload too damaged to list: the message says less
        return []


def deliver_object(planner: LoadPlanner, req: ReadItem, obj: Any, data: bytes) -> None:
    """Give DCP's planner the object of ``req``.  The default planner's
    ``load_bytes`` would unpickle ``data`` again with the full unpickler:
    for it (and subclasses that keep its ``load_bytes``) the safely rebuilt
    object is put in place the way that method does; a custom planner's own
    ``load_bytes`` gets the bytes, which passed the restricted unpickler."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        put_object(planner, req, obj)
    else:
        planner.load_bytes(req, io.BytesIO(data))


def put_object(planner: DefaultLoadPlanner, req: ReadItem, obj: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does with the object it unpickled."""
    fqn = req.dest_index.fqn
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


def check_bytes_targets(items: Iterable[ReadItem], planner: LoadPlanner, where: str) -> None:
    """Refuse, before anything is read, a bytes item whose target in the
    caller's state dict is a tensor (the checkpoint says object, the caller
    expects a tensor: loading would replace the tensor with whatever the
    checkpoint holds).  Planners that do not keep a ``state_dict`` mapping
    are not checked here (their objects still pass the restricted unpickler)."""
    state_dict = getattr(planner, "state_dict", None)
    if not isinstance(state_dict, dict):
        return
    for req in items:
        if req.type != LoadItemType.BYTE_IO:
            continue
        fqn = req.dest_index.fqn
        target = state_dict.get(fqn)
        if isinstance(target, torch.Tensor):
            raise fmt.CheckpointFormatError(
                f"{where}: {fqn!r} is stored as an object (a bytes item), but the state dict being loaded "
                f"holds a tensor ({target.dtype}, shape {list(target.shape)}) under that key; refusing to "
                f"replace a tensor with an object. Check that this is the checkpoint you meant, or load "
                f"{fqn!r} into a state dict that holds an object there"
            )
