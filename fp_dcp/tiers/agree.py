"""Every rank's outcome of one phase of the tiers' work, gathered.

The tiers run collectives in background threads (a save's replication) and
in restores; a rank whose local work raised between two collectives would
leave every other rank waiting in the next one until the group's timeout
(30 minutes by default).  :func:`exchange` ends such a phase with one
gather of every rank's result or error, so that a failure on one rank
makes every rank raise at once, naming the rank and its error.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

__all__ = ["TierError", "exchange"]


class TierError(RuntimeError):
    """A phase of the tiers' work failed on some rank (the message names
    the ranks and their errors)."""


def exchange(group, world: int, what: str, work: Callable[[], Any],
             error: type[TierError] = TierError) -> list[Any]:
    """Run ``work`` here and gather every rank's result (a list by rank);
    when it raised on any rank, every rank raises ``error`` naming the
    ranks and their errors (no rank is left waiting in a later collective)."""
    err = mine = local = None
    try:
        mine = work()
    except Exception as e:  # noqa: BLE001 - every rank learns it, then raises
        err, local = f"{type(e).__name__}: {e}", e
    out: list = [None] * world
    dist.all_gather_object(out, (mine, err), group=group)
    failed = [(r, e) for r, (_, e) in enumerate(out) if e is not None]
    if failed:
        raise error(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed)) from local
    return [v for v, _ in out]
