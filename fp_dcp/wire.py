"""Plain data between ranks, without pickle: JSON decoded against a *spec*
(``int``, ``float``, ``str``, ``bool``, ``None``, ``maybe(spec)``, ``[spec]``,
``(spec, ...)``, ``{str: spec}``, ``{"key": spec, ...}``); a bad message is a
:class:`WireError` naming the sender, on every rank."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WireError", "maybe", "gather", "broadcast", "decode", "encode", "MAX_MESSAGE_BYTES"]

#: The largest message a rank may send in one exchange (a restore's
#: inventory of a large job is some megabytes).
MAX_MESSAGE_BYTES = 256 << 20
_INT_BOUND = 1 << 63


class WireError(RuntimeError):
    """A message from a peer rank that is oversized, not JSON, or not the
    shape its exchange sends (the message names the rank and the fault)."""


class maybe:  # noqa: N801 - reads as part of a spec
    """``None`` or ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


def encode(value: Any) -> bytes:
    """``value`` as compact JSON (tuples become lists); ``ValueError`` for
    what JSON cannot hold (NaN included)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not plain JSON")


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("an object with a key twice")
    return out


def decode(blob: bytes, spec: Any, where: str) -> Any:
    """``blob`` parsed as JSON and checked against ``spec``; :class:`WireError`
    naming ``where`` otherwise."""
    try:
        value = json.loads(blob.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise WireError(f"{where}: not a plain JSON message ({type(e).__name__}: {str(e)[:200]})") from None
    try:
        return _check(value, spec, "$")
    except RecursionError:
        raise WireError(f"{where}: nested too deep") from None
    except WireError as e:
        raise WireError(f"{where}: {e}") from None


def _check(value: Any, spec: Any, at: str) -> Any:
    if spec is None:
        if value is not None:
            raise WireError(f"{at} must be null, got {type(value).__name__}")
        return None
    if isinstance(spec, maybe):
        return None if value is None else _check(value, spec.spec, at)
    if spec is int:
        if type(value) is not int or not -_INT_BOUND <= value < _INT_BOUND:
            raise WireError(f"{at} must be an integer, got {type(value).__name__}")
        return value
    if spec is float:
        if type(value) not in (int, float):
            raise WireError(f"{at} must be a number, got {type(value).__name__}")
        return float(value)
    if spec in (str, bool):
        if type(value) is not spec:
            raise WireError(f"{at} must be a {spec.__name__}, got {type(value).__name__}")
        return value
    if isinstance(spec, list):
        if type(value) is not list:
            raise WireError(f"{at} must be a list, got {type(value).__name__}")
        return [_check(v, spec[0], f"{at}[{i}]") for i, v in enumerate(value)]
    if isinstance(spec, tuple):
        if type(value) is not list or len(value) != len(spec):
            raise WireError(f"{at} must be a list of {len(spec)}, got "
                            f"{len(value) if type(value) is list else type(value).__name__}")
        return tuple(_check(v, s, f"{at}[{i}]") for i, (v, s) in enumerate(zip(value, spec)))
    if isinstance(spec, dict):
        if type(value) is not dict:
            raise WireError(f"{at} must be an object, got {type(value).__name__}")
        if list(spec) == [str]:
            return {k: _check(v, spec[str], f"{at}[{k[:60]!r}]") for k, v in value.items()}
        if set(value) != set(spec):
            raise WireError(f"{at} must have the keys {sorted(spec)}, got {sorted(value)[:20]}")
        return {k: _check(value[k], s, f"{at}.{k}") for k, s in spec.items()}
    raise TypeError(f"not a wire spec: {spec!r}")


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _limit_error(what: str, sizes: list[int], limit: int) -> WireError | None:
    bad = [(r, n) for r, n in enumerate(sizes) if not 0 <= n <= limit]
    if not bad:
        return None
    return WireError(f"{what}: " + "; ".join(f"rank {r} sent a message of {n} bytes (at most {limit} are accepted)"
                                             for r, n in bad))


def gather(value: Any, spec: Any, group=None, *, what: str = "exchange", limit: int = MAX_MESSAGE_BYTES) -> list:
    """Every rank's ``value`` (this one's included), by rank of ``group``,
    each decoded against ``spec``.  Every rank calls it; each raises the same
    :class:`WireError` when some rank's message is oversized or malformed."""
    blob = encode(value)
    device = _device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes_t, size, group=group)
    sizes = [int(t.item()) for t in sizes_t]
    err = _limit_error(what, sizes, limit)
    if err is not None:
        raise err
    width = max(sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, mine.to(device), group=group)
    return [decode(bytes(t[: n].cpu().numpy()), spec, f"{what}: rank {r}'s message") for r, (t, n)
            in enumerate(zip(out, sizes))]


def broadcast(value: Any, spec: Any, src: int, group=None, *, what: str = "exchange",
              payload: bytes | None = None, limit: int = MAX_MESSAGE_BYTES) -> tuple[Any, bytes]:
    """``src``'s ``value`` (decoded against ``spec``) and raw ``payload``
    bytes (a checkpoint's metadata, say, which the caller decodes with its
    own checks) on every rank of ``group``; ``src`` is a group rank.  The
    other ranks' ``value`` and ``payload`` are ignored."""
    device = _device(group)
    me = dist.get_rank(group)
    blob = encode(value) if me == src else b""
    raw = (payload or b"") if me == src else b""
    sizes_t = torch.tensor([len(blob), len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(sizes_t, group_src=src, group=group)
    n, m = (int(x) for x in sizes_t.cpu().tolist())
    if not (0 <= n <= limit and 0 <= m <= limit - n):
        raise WireError(f"{what}: rank {src} sent a message of {n} + {m} bytes (at most {limit} are accepted)")
    buf = torch.zeros(n + m, dtype=torch.uint8)
    if me == src and n + m:
        buf[:] = torch.frombuffer(bytearray(blob + raw), dtype=torch.uint8)
    buf = buf.to(device)
    if n + m:
        dist.broadcast(buf, group_src=src, group=group)
    data = bytes(buf.cpu().numpy())
    return decode(data[:n], spec, f"{what}: rank {src}'s message"), data[n:]
