"""Where each staged tensor goes (pure): :func:`walk` / :func:`build` take a
state dict apart and back; :func:`plan` places tensors in the arena or the
spill file; :func:`views` are the tensors viewing a buffer so laid out."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterator

import numpy as np
import torch

from fp_dcp import _dcp_hooks
from fp_dcp.format import align_up

__all__ = ["ARENA", "SPILL", "EMPTY", "Layout", "walk", "build", "meta", "plan", "views", "chunk_windows"]

try:  # torch built without distributed
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

# Where a staged tensor lives.
ARENA, SPILL, EMPTY = 0, 1, 2


# ------------------------------------------------------------ state-dict walk


def walk(obj: Any, leaves: list[torch.Tensor], values: list[Any]) -> tuple:
    """The skeleton of ``obj``: containers kept, tensors replaced by their leaf
    index, anything else by its index in ``values``.  Comparable with ``==``."""
    t = type(obj)
    if (t is torch.Tensor or t is torch.nn.Parameter) and obj.layout == torch.strided:  # the common leaf, first
        # an alias of its storage, shape and strides as they are now, with no
        # autograd link (``detach()`` without the dispatcher: a third faster)
        leaves.append(obj.data)
        return ("T", len(leaves) - 1)
    if DTensor is not None and isinstance(obj, DTensor):
        leaves.append(_dcp_hooks.dtensor_local(obj))
        return ("D", len(leaves) - 1, _dcp_hooks.dtensor_spec(obj))
    if t is dict or t is collections.OrderedDict:
        return ("M", t, tuple([(k, walk(v, leaves, values)) for k, v in obj.items()]))
    if t is list or t is tuple:
        return ("L" if t is list else "U", tuple([walk(v, leaves, values) for v in obj]))
    values.append(obj)  # other tensor subclasses and layouts included: deep-copied
    return ("V", len(values) - 1)


def build(node: tuple, tensors: list[torch.Tensor | None], values: list[Any], root: type | None = None) -> Any:
    """The state dict of skeleton ``node`` around ``tensors`` and ``values``;
    a top-level mapping of type ``root`` when given (else the original's).
    A ``DTensor`` is rebuilt around its staged local shard with the same
    mesh, placements, shape and stride."""
    kind = node[0]
    if kind == "T":
        return tensors[node[1]]
    if kind == "D":
        return _dcp_hooks.dtensor_from_spec(tensors[node[1]], node[2])
    if kind == "M":
        out = (root or node[1])()
        for k, sub in node[2]:
            out[k] = build(sub, tensors, values)
        return out
    if kind == "L":
        return [build(sub, tensors, values) for sub in node[1]]
    if kind == "U":
        return tuple(build(sub, tensors, values) for sub in node[1])
    return values[node[1]]


def meta(t: torch.Tensor) -> tuple:
    """What the layout of a leaf depends on: (dtype, shape, device)."""
    return (t.dtype, tuple(t.shape), t.device)


# ------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a state dict is staged (one entry per leaf, in
    :func:`walk` order), and the sizes of the arena and the spill file."""

    metas: tuple
    nbytes: tuple[int, ...]
    where: tuple[int, ...]  # ARENA, SPILL or EMPTY
    offset: tuple[int, ...]  # in the arena, or in the spill file
    arena_bytes: int  # header + resident tensors (+ ring)
    ring_offset: int
    slot_bytes: int  # 0: everything fits
    spill_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(self.nbytes)

    @property
    def spilled_bytes(self) -> int:
        return sum(n for n, w in zip(self.nbytes, self.where) if w == SPILL)


def plan(metas: tuple, options: Any, alignment: int) -> Layout:
    """The layout of leaves ``metas`` (see :func:`meta`) under ``options``
    (``pack_threshold_bytes``, ``pack_alignment_bytes``,
    ``staging_memory_limit_bytes``, ``cuda_chunk_bytes``); page 0 is the
    arena's header, ``alignment`` the direct-I/O boundary."""
    nbytes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for dtype, shape, _ in metas]
    threshold, packed = options.pack_threshold_bytes, options.pack_alignment_bytes

    def fill(budget: int | None) -> tuple[list[int], list[int], int, int]:
        """Tensors in the arena (first fit, page 0 the header) while they end
        within ``budget`` (None: all of them), the others in the spill file:
        (where, offset, arena end, spill end)."""
        where, offset = [], []
        pos, spos = alignment, 0
        for n in nbytes:
            if n == 0:
                where.append(EMPTY)
                offset.append(0)
                continue
            off = align_up(pos, alignment if n >= threshold else packed)
            if budget is None or off + n <= budget:
                where.append(ARENA)
                offset.append(off)
                pos = off + n
            else:
                soff = align_up(spos, alignment)
                where.append(SPILL)
                offset.append(soff)
                spos = soff + n
        return where, offset, align_up(pos, alignment), align_up(spos, alignment)

    where, offset, full, _ = fill(None)
    cap = options.staging_memory_limit_bytes
    if cap is None or full <= cap:
        return Layout(metas, tuple(nbytes), tuple(where), tuple(offset), full, full, 0, 0)

    # Past the limit: two ring slots, the rest of the budget for resident tensors.
    slot = min(options.cuda_chunk_bytes, (cap - alignment) // 4) // alignment * alignment
    budget = (cap - 2 * slot) // alignment * alignment
    if slot < alignment or budget < alignment:
        raise ValueError(
            f"FastPersistOptions.staging_memory_limit_bytes={cap} is too small to stream "
            f"through: allow at least {5 * alignment} bytes"
        )
    where, offset, ring, spill = fill(budget)
    return Layout(metas, tuple(nbytes), tuple(where), tuple(offset), ring + 2 * slot, ring, slot, spill)


def views(buf: Any, spill_map: Any, layout: Layout) -> list[torch.Tensor | None]:
    """Tensors viewing ``buf`` (the arena) and ``spill_map`` (the spill
    file's mapping; None for the spilled ones without one) as laid out."""
    out: list[torch.Tensor | None] = []
    for (dtype, shape, _), where, off, n in zip(layout.metas, layout.where, layout.offset, layout.nbytes):
        if where == EMPTY:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        src = buf if where == ARENA else spill_map
        if src is None:
            out.append(None)
            continue
        out.append(torch.frombuffer(src, dtype=dtype, count=n // dtype.itemsize, offset=off).view(shape))
    return out


# ------------------------------------------------------------ chunk windows


def chunk_windows(offsets: list[int], lengths: list[int], chunk: int, end: int) -> Iterator[tuple[int, list]]:
    """For each window ``[start, start + chunk)`` of ``[0, end)``: ``(start,
    [(i, a, b), ...])``, the file range ``[a, b)`` of each extent ``i`` in it
    (``offsets`` ascending, extents not overlapping), in order; an empty
    extent is in none.  Each extent is looked at once per window it is in,
    not once per window."""
    first = 0
    for start in range(0, end, chunk):
        stop = start + chunk
        while first < len(offsets) and offsets[first] + lengths[first] <= start:
            first += 1
        parts = []
        i = first
        while i < len(offsets) and offsets[i] < stop:
            a, b = max(offsets[i], start), min(offsets[i] + lengths[i], stop)
            if a < b:
                parts.append((i, a, b))
            i += 1
        yield start, parts
