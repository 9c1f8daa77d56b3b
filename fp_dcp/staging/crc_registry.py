"""The CRC-32Cs a staging copy computed, kept for the save that writes them:
the stager records them (:func:`remember`), the writer looks them up by the
address of the bytes it writes (:func:`staged_checksums`) and drops them
when its ``write_data`` is done (:func:`forget_staged_checksums`)."""

# Entries are kept by arena address: (the buffer -- held, so that its address
# cannot be reused while the entry exists -- its size, {arena offset: (bytes,
# CRCs)}).  An entry lives from the end of a staging copy until the save's
# write_data has used it, the next staging into that arena starts, or the
# arena is closed: the CRCs are only ever used by the save they were staged
# for.  The registry is per process: a checkpoint process records the CRCs
# that came with the pickled staged state dict.

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

__all__ = ["remember", "staged_checksums", "forget_staged_checksums", "any_staged_checksums"]

# Arenas whose CRCs are kept at most: a writer has one arena (two while a
# save moves it to shared memory), a checkpoint process serves a few writers;
# the oldest entry goes first.
_KEEP = 4

_STAGED: "collections.OrderedDict[int, tuple[Any, int, dict[int, tuple[int, np.ndarray]]]]" = (
    collections.OrderedDict()
)
_LOCK = threading.Lock()


def remember(buf: Any, address: int, size: int, crcs: dict[int, tuple[int, np.ndarray]]) -> None:
    """Record the CRCs of a staging copy into ``buf`` (``size`` bytes at
    ``address``), ``{arena offset: (bytes, CRCs)}``, replacing the arena's
    previous ones (none are kept when ``crcs`` is empty)."""
    with _LOCK:
        _STAGED.pop(address, None)
        if crcs:
            _STAGED[address] = (buf, size, crcs)
            while len(_STAGED) > _KEEP:
                _STAGED.popitem(last=False)


def forget_staged_checksums(addresses: Any = None) -> None:
    """Drop the staging CRCs of the arenas at ``addresses`` (all when None)."""
    with _LOCK:
        if addresses is None:
            _STAGED.clear()
        for a in addresses or ():
            _STAGED.pop(a, None)


def any_staged_checksums() -> bool:
    """Whether any staging copy's CRCs are kept (a save that staged nothing
    need not look each of its items up)."""
    return bool(_STAGED)


def staged_checksums(address: int, nbytes: int) -> tuple[int, np.ndarray] | None:
    """``(arena address, CRCs)`` of the tensor bytes at ``address`` if the
    staging copy that put exactly these ``nbytes`` there checksummed them
    (one CRC-32C per CHECKSUM_BLOCK_BYTES block from ``address``), else None."""
    with _LOCK:
        for base, (_, size, crcs) in _STAGED.items():
            if base <= address < base + size:
                hit = crcs.get(address - base)
                if hit is not None and hit[0] == nbytes:
                    return base, hit[1]
                return None
    return None

