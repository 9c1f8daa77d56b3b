"""Loading DCP's bytes items without running their code: only what torch's
restricted unpickler rebuilds (and ``io.BytesIO``), else
:class:`UnsafeObjectError` naming the key, the globals and the way out
(``allow_pickle=True`` for trusted checkpoints); never over a tensor."""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import threading
from typing import Any, Iterable, Iterator, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from fp_dcp import format as fmt

__all__ = ["UnsafeObjectError", "load_object", "deliver_object", "put_object", "check_bytes_targets"]


class UnsafeObjectError(fmt.CheckpointFormatError):
    """A stored object needs a type that the restricted unpickler does not allow."""


class _PlainBytesIO(io.BytesIO):
    """What a stored ``io.BytesIO`` is rebuilt as inside the restricted
    unpickler: its bytes and position only (no attributes, nothing called);
    :func:`load_object` hands out a plain ``io.BytesIO`` in its place."""

    def __init__(self, initial_bytes: Any = b"") -> None:
        if type(initial_bytes) is not bytes:
            raise pickle.UnpicklingError("a stored io.BytesIO holds something other than bytes")
        super().__init__(initial_bytes)

    def __setstate__(self, state: Any) -> None:
        if (type(state) is not tuple or len(state) != 3 or type(state[0]) is not bytes
                or type(state[1]) is not int or not 0 <= state[1] <= len(state[0]) or state[2]):
            raise pickle.UnpicklingError("a stored io.BytesIO has a state other than its bytes and position")
        super().__setstate__((state[0], state[1], None))  # type: ignore[misc]  # typeshed lacks BytesIO's

    def plain(self) -> io.BytesIO:
        out = io.BytesIO(self.getvalue())
        out.seek(self.tell())
        return out


# "_io.BytesIO" in a payload means _PlainBytesIO, only while fp_dcp loads an
# object (torch's allow-list is process-wide: it is added to while any load
# runs and taken out after the last one)
_PLAIN_DATA = torch.serialization.safe_globals([(_PlainBytesIO, "_io.BytesIO")])
_plain_data_lock = threading.Lock()
_plain_data_users = 0


@contextlib.contextmanager
def _plain_data_allowed() -> Iterator[None]:
    global _plain_data_users
    with _plain_data_lock:
        if _plain_data_users == 0:
            _PLAIN_DATA.__enter__()
        _plain_data_users += 1
    try:
        yield
    finally:
        with _plain_data_lock:
            _plain_data_users -= 1
            if _plain_data_users == 0:
                _PLAIN_DATA.__exit__(None, None, None)


def _plain(obj: Any) -> Any:
    """``obj`` with every rebuilt stream (in it, or in its dicts, lists and
    tuples) a plain ``io.BytesIO``."""
    if isinstance(obj, _PlainBytesIO):
        return obj.plain()
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _plain(v)
    elif isinstance(obj, list):
        obj[:] = map(_plain, obj)
    elif type(obj) is tuple:
        return tuple(map(_plain, obj))
    return obj


def load_object(data: bytes, key: str, where: str, allow_pickle: bool) -> Any:
    """The object stored as ``data`` under ``key`` (``where`` names the
    checkpoint in errors), rebuilt by torch's restricted unpickler (with
    ``io.BytesIO`` as plain data) unless ``allow_pickle``."""
    try:
        if allow_pickle:
            return torch.load(io.BytesIO(data), weights_only=False)
        with _plain_data_allowed():
            obj = torch.load(io.BytesIO(data), weights_only=True)
        return _plain(obj) if b"BytesIO" in data else obj
    except pickle.UnpicklingError as e:
        if allow_pickle:
            raise fmt.CheckpointFormatError(f"{where}: the object stored under {key!r} cannot be read: {e}") from None
        stream = re.search(r"a stored io\.BytesIO [^\n]*", str(e))
        if stream:  # torch's message wraps _PlainBytesIO's
            raise UnsafeObjectError(
                f"{where}: refusing to load the object stored under {key!r}: {stream.group(0)} (fp_dcp reads a "
                f"stream as plain data: its bytes and position). If you trust this checkpoint, "
                f"load it with FastPersistReader(path, allow_pickle=True) (environment FP_DCP_ALLOW_PICKLE=1)"
            ) from None
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
    """Give DCP's planner the object of ``req``: put in place as
    ``DefaultLoadPlanner.load_bytes`` does (without unpickling again), or the
    already checked bytes to a custom ``load_bytes``."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        put_object(cast(DefaultLoadPlanner, planner), req, obj)  # its load_bytes is DefaultLoadPlanner's
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
    """Refuse, before anything is read, a bytes item whose target in the caller's
    state dict is a tensor (planners without a ``state_dict`` are not checked)."""
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
