"""Every rank's outcome of one phase, gathered as plain data
(:func:`exchange`), so a failure on one rank makes every rank raise at once."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from fp_dcp import wire

__all__ = ["TierError", "exchange", "share"]


class TierError(RuntimeError):
    """A phase of the tiers' work failed on some rank (the message names
    the ranks and their errors)."""


def exchange(group, world: int, what: str, work: Callable[[], Any],
             error: type[TierError] = TierError, spec: Any = None) -> list[Any]:
    """Run ``work`` here and gather every rank's result (decoded against
    ``spec``); when it raised on any rank, every rank raises ``error`` naming
    the ranks and their errors."""
    err = mine = local = None
    try:
        mine = work()
        wire.encode(mine)  # not plain data: this rank's error, sent as such
    except Exception as e:  # noqa: BLE001 - every rank learns it, then raises
        mine, err, local = None, f"{type(e).__name__}: {e}", e
    out = wire.gather((mine, err), (wire.maybe(spec), wire.maybe(str)), group, what=what)
    failed = [(r, e) for r, (_, e) in enumerate(out) if e is not None]
    if failed:
        raise error(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed)) from local
    if len(out) != world:
        raise error(f"{what}: {len(out)} answers from a group of {world}")
    return [v for v, _ in out]


def share(group, src: int, what: str, work: Callable[[], bytes],
          error: type[TierError] = TierError) -> bytes:
    """Bytes that rank ``src`` of ``group`` reads (``work``, run there only),
    on every rank; when it raised there, every rank raises ``error`` naming
    ``src`` and the error."""
    err, blob, local = None, b"", None
    if dist.get_rank(group) == src:
        try:
            blob = bytes(work())
        except Exception as e:  # noqa: BLE001 - every rank learns it
            err, local = f"{type(e).__name__}: {e}", e
    err, blob = wire.broadcast(err, wire.maybe(str), src, group, what=what, payload=blob)
    if err is not None:
        raise error(f"{what} failed on rank {src}: {err}") from local
    return blob
