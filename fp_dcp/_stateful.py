"""DCP's ``_stateful_to_state_dict`` without its per-key logging, and a
faster ``isinstance(value, Stateful)`` for ``dcp.load``: installed by the
default-storage switch and when an fp_dcp writer, reader or planner is made
(a lazy ``async_save`` of 9,245 keys otherwise spends about 0.3 s in the
records before it returns: ``benchmarks/bench_async.py --mix small``).

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

``dcp.load`` checks every value with ``isinstance(value, Stateful)``, a
runtime protocol check of tens of microseconds.  :func:`quick_stateful`
gives the same answer for a plain tensor or scalar in a fraction of that
(the protocol's own steps, minus the attribute look-ups that cannot
succeed), and asks the protocol for anything else.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import inspect
import logging
from typing import Any, Callable

import torch

__all__ = ["installable", "make", "NAME", "LOAD_NAME", "quick_stateful", "install"]

NAME = ("state_dict_saver", "_stateful_to_state_dict")
# where dcp.load finds the protocol it checks every value against
LOAD_NAME = ("state_dict_loader", "Stateful")

# sha256 of the source of DCP's _stateful_to_state_dict and of the logging
# it goes through (the same text in torch 2.10 to 2.15).
_KNOWN = {
    "_stateful_to_state_dict": "06b35ac6e573fc2d28955a6a6674f34ed1ed5e155ea15d792a26c6004b4471e1",
    "_dcp_method_logger": "d3aca7bc8aaf3b15",
    "_get_msg_dict": "8c900aa534eee972",
}

# Values of these exact types are never Stateful (no instance attributes).
_NEVER: frozenset[type] = frozenset({int, float, bool, str, bytes, type(None)})
_TENSORS: frozenset[type] = frozenset({torch.Tensor, torch.nn.Parameter})


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


def quick_stateful(stateful: Any) -> type:
    """A stand-in for DCP's ``Stateful`` protocol: ``isinstance`` and
    ``issubclass`` answer as with ``stateful``."""
    abc_check = abc.ABCMeta.__instancecheck__
    # each plain type's classes' namespaces, as live views (a state_dict set
    # on one later is seen)
    namespaces = {t: tuple(vars(k) for k in t.__mro__) for t in _NEVER | _TENSORS}

    class _Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            mro = namespaces.get(type(obj))
            # the protocol's answer when the value has no state_dict at all,
            # neither on its type nor its own (getattr_static's look-up)
            if mro is not None and "state_dict" not in getattr(obj, "__dict__", ()):
                for ns in mro:
                    if "state_dict" in ns:
                        break
                else:
                    return abc_check(stateful, obj)
            return isinstance(obj, stateful)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return issubclass(sub, stateful)

    return _Meta("Stateful", (), {"__doc__": stateful.__doc__, "__module__": __name__,
                                  "__wrapped_stock__": stateful})


def _ours(obj: Any) -> bool:
    return getattr(obj, "__wrapped_stock__", None) is not None


def install(saved: dict[tuple[str, str], Any] | None = None, module: Callable[[str], Any] | None = None) -> list[str]:
    """Install the state-dict copy without logging in ``dcp.save`` and the
    quick protocol check in ``dcp.load`` (each where the installed torch is
    the one they replace); idempotent.  ``saved``: where to keep DCP's own
    objects (kept if already there) for the caller to restore.  Returns the
    names not installed."""
    module = module or (lambda name: importlib.import_module(f"torch.distributed.checkpoint.{name}"))
    skipped = []
    for (mod_name, name), fits, replacement in ((NAME, installable, make), (LOAD_NAME, _load_fits, quick_stateful)):
        try:
            mod = module(mod_name)
        except ImportError:
            skipped.append(f"{mod_name}.{name}")
            continue
        current = getattr(mod, name, None)
        stock = getattr(current, "__wrapped_stock__", current)
        if _ours(current):  # installed already (checked then)
            if saved is not None:
                saved.setdefault((mod_name, name), stock)
            continue
        if stock is None or not fits(mod, stock):
            skipped.append(f"{mod_name}.{name}")
            continue
        if saved is not None:
            saved.setdefault((mod_name, name), stock)
        setattr(mod, name, replacement(stock))
    return skipped


def _load_fits(mod: Any, stock: Any) -> bool:
    """Whether ``stock`` is DCP's ``Stateful`` and ``dcp.load`` looks it up
    by its module-level name."""
    try:
        from torch.distributed.checkpoint.stateful import Stateful

        return stock is Stateful and LOAD_NAME[1] in inspect.unwrap(mod.load).__code__.co_names
    except (AttributeError, ImportError, TypeError):
        return False
