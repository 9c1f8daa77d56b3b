"""DCP's ``_stateful_to_state_dict`` without its per-key logging, for the
default-storage switch.

Before any planner runs, ``dcp.save`` / ``dcp.async_save`` copy the state
dict through ``_stateful_to_state_dict``: per key it builds a log message
(a uuid, the process group's rank, world size and backend), sends a start
and an end record to DCP's own logger (level DEBUG, one ``NullHandler``, not
propagated: nobody receives them) and checks the value against the
``Stateful`` protocol.  :func:`stateful_to_state_dict` returns the same
dict, calls the same ``state_dict()`` methods in the same order and raises
the same exceptions; it leaves out the records only while that logger
still sends them nowhere (else it runs DCP's function), and checks the
protocol only where the answer is not known from the value's type.

:func:`installable` says whether the installed torch's function is the one
this replaces (its source and its logger's, compared with the known text),
and whether ``save`` / ``async_save`` find it by its module-level name.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Any, Callable

import torch

__all__ = ["installable", "make", "NAME"]

NAME = ("state_dict_saver", "_stateful_to_state_dict")

# sha256 of the source of DCP's _stateful_to_state_dict and of the logging
# it goes through (the same text in torch 2.10 to 2.15).
_KNOWN = {
    "_stateful_to_state_dict": "06b35ac6e573fc2d28955a6a6674f34ed1ed5e155ea15d792a26c6004b4471e1",
    "_dcp_method_logger": "d3aca7bc8aaf3b15",
    "_get_msg_dict": "8c900aa534eee972",
}

# Values of these exact types are never Stateful (no instance attributes).
_NEVER = frozenset({int, float, bool, str, bytes, type(None)})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def _digest(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def installable(saver: Any, fn: Any) -> bool:
    """Whether ``fn`` (``saver._stateful_to_state_dict`` as DCP made it) and
    the logging it goes through are what this replaces, and ``saver``
    (DCP's ``state_dict_saver`` module) looks it up by name where it is called."""
    try:
        from torch.distributed.checkpoint import logger as dcp_logger

        if _digest(fn) != _KNOWN["_stateful_to_state_dict"]:
            return False
        for name in ("_dcp_method_logger", "_get_msg_dict"):
            if not _digest(getattr(dcp_logger, name)).startswith(_KNOWN[name]):
                return False
        if not isinstance(getattr(dcp_logger, "_dcp_logger", None), logging.Logger):
            return False
        return all(NAME[1] in inspect.unwrap(getattr(saver, caller)).__code__.co_names
                   for caller in ("save", "async_save"))
    except (AttributeError, OSError, TypeError):  # no source, or not the shape we know
        return False


def _nobody_listens() -> bool:
    """Whether DCP's logger sends its records nowhere."""
    from torch.distributed.checkpoint import logger as dcp_logger

    lg = dcp_logger._dcp_logger
    quiet = all(type(h) is logging.NullHandler for h in lg.handlers)
    return type(lg) is logging.Logger and not lg.propagate and not lg.filters and quiet


def make(stock: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """The replacement for ``stock`` (DCP's function)."""
    from torch.distributed.checkpoint.stateful import Stateful

    never, tensors = _NEVER, _TENSORS

    def _stateful_to_state_dict(state_dict: dict) -> dict:
        """Creates a shallow copy of `state_dict` where `state_dict` is called for each Stateful object."""
        if not _nobody_listens():
            return stock(state_dict)
        out = {}
        for key, elem in state_dict.items():
            t = type(elem)
            if t in never or (t in tensors and not hasattr(elem, "state_dict")):
                out[key] = elem
            else:
                out[key] = elem.state_dict() if isinstance(elem, Stateful) else elem
        return out

    _stateful_to_state_dict.__wrapped_stock__ = stock  # type: ignore[attr-defined]
    return _stateful_to_state_dict
