"""The balancer: :func:`plan_placement` turns one :class:`Holdings` per rank into
a :class:`Placement` whose pieces tile each item exactly once.  Deterministic
and pure; :class:`PlanCache` keeps placements by structure."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "UNSIZED",
    "Holdings",
    "RankPieces",
    "Placement",
    "PlanCache",
    "item_key",
    "item_keys",
    "make_holdings",
    "structure_key",
    "plan_placement",
    "water_fill",
    "cut_stream",
]

# ``nbytes`` of an item whose size is not known at plan time (a bytes item).
UNSIZED = -1


def item_key(fqn: str, offset: Sequence[int] | None) -> int:
    """A stable 64-bit key of a ``MetadataIndex`` (``fqn`` and chunk ``offset``),
    the same in every process (unlike ``hash``); the planner refuses a key
    whose holders disagree on its size."""
    return item_keys([(fqn, offset)])[0]


def item_keys(indexes: Iterable[tuple[str, Sequence[int] | None]]) -> list[int]:
    """:func:`item_key` of each ``(fqn, offset)``; an offset's text is made
    once per distinct offset (a rank's plain tensors share a few)."""
    suffixes: dict[tuple | None, str] = {None: "\0-"}
    out = []
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for fqn, offset in indexes:
        at = None if offset is None else tuple(offset)
        suffix = suffixes.get(at)
        if suffix is None:
            assert at is not None  # (None's is there from the start)
            suffix = suffixes[at] = "\0" + ",".join(str(int(o)) for o in at)
        out.append(from_bytes(blake2b((fqn + suffix).encode(), digest_size=8).digest(), "little"))
    return out


@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one rank holds, in plan order: ``keys[i]`` (:func:`item_key`) and
    ``nbytes[i]`` (``UNSIZED`` for a bytes item); ``granularity``: the alignment
    split points keep; items below ``small_bytes`` are never split."""

    rank: int
    host: str
    n_dirs: int
    granularity: int
    small_bytes: int
    keys: np.ndarray
    nbytes: np.ndarray
    digest: str
    keys_digest: str = ""


def make_holdings(
    rank: int,
    host: str,
    keys: Sequence[int] | np.ndarray,
    nbytes: Sequence[int] | np.ndarray,
    *,
    n_dirs: int = 1,
    granularity: int = 64 << 10,
    small_bytes: int = 256 << 10,
) -> Holdings:
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    nbytes = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    if keys.shape != nbytes.shape:
        raise ValueError(f"rank {rank}: {len(keys)} item keys but {len(nbytes)} sizes")
    if n_dirs < 1:
        raise ValueError(f"rank {rank}: n_dirs must be >= 1, got {n_dirs}")
    if granularity <= 0 or granularity & (granularity - 1):
        raise ValueError(f"rank {rank}: granularity must be a power of two, got {granularity}")
    if len(nbytes) and nbytes.min() < UNSIZED:
        raise ValueError(f"rank {rank}: negative item size")
    keys_digest = hashlib.blake2b(np.ascontiguousarray(keys).tobytes(), digest_size=16).hexdigest()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rank}\0{host}\0{n_dirs}\0{granularity}\0{small_bytes}\0{keys_digest}\0".encode())
    h.update(np.ascontiguousarray(nbytes).tobytes())
    return Holdings(rank, host, n_dirs, granularity, small_bytes, keys, nbytes, h.hexdigest(), keys_digest)


def structure_key(holdings: Sequence[Holdings]) -> str:
    """The cache key of a save's structure: every rank's digest, in rank order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(len(holdings)).encode())
    for x in holdings:
        h.update(x.digest.encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class RankPieces:
    """One rank's share: piece ``i`` is bytes ``[offset[i], offset[i] +
    length[i])`` of its item ``local[i]``, to data directory ``device[i]``
    (``length[i] == UNSIZED``: the whole item)."""

    local: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    device: np.ndarray

    def __len__(self) -> int:
        return len(self.local)

    def sized_bytes(self) -> int:
        return int(self.length[self.length > 0].sum())


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every byte goes.  ``loads[r]``: bytes (of sized items) rank ``r``
    writes; ``device_loads[host]``: bytes per data directory of that host;
    ``unsized_counts[r]``: bytes items rank ``r`` writes."""

    pieces: list[RankPieces]
    loads: np.ndarray
    device_loads: dict[str, np.ndarray]
    unsized_counts: np.ndarray
    items: int
    total_bytes: int
    key: str

    def balance(self) -> float:
        """max / mean of the per-rank loads (1.0 is perfect)."""
        mean = self.total_bytes / max(1, len(self.loads))
        return float(self.loads.max()) / mean if mean > 0 else 1.0


class PlanCache:
    """A small LRU of placements keyed by :func:`structure_key`."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, Placement] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Placement | None:
        p = self._entries.get(key)
        if p is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return p

    def put(self, key: str, placement: Placement) -> None:
        self._entries[key] = placement
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------- pieces


def water_fill(loads: np.ndarray, total: int) -> np.ndarray:
    """Quotas ``q >= 0`` with ``sum(q) == total`` that minimise ``max(loads + q)``:
    every rank below the level ``L`` is raised to it.  Floats."""
    loads = np.asarray(loads, dtype=np.float64)
    n = len(loads)
    if n == 0 or total <= 0:
        return np.zeros(n)
    order = np.argsort(loads, kind="stable")
    ls = loads[order]
    prefix = np.cumsum(ls)
    # filling the k lowest up to ls[k-1] costs k * ls[k-1] - prefix[k-1]
    k_arr = np.arange(1, n + 1)
    cost = k_arr * ls - prefix
    k = int(np.searchsorted(cost, total, side="right"))  # ranks that end up filled
    k = max(1, min(k, n))
    level = (total + prefix[k - 1]) / k
    q = np.maximum(0.0, level - loads)
    q[loads >= level] = 0.0
    s = q.sum()
    if s > 0:
        q *= total / s  # exact sum despite rounding
    return q


def cut_stream(
    sizes: np.ndarray, quotas: np.ndarray, granularity: int, small_bytes: int
) -> np.ndarray:
    """Cut positions of a stream of items of ``sizes`` into ``len(quotas)``
    segments of about the quotas' lengths; cuts inside an item at multiples of
    ``granularity``, items under ``small_bytes`` not cut."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    n = len(quotas)
    ideal = np.rint(np.cumsum(np.asarray(quotas, dtype=np.float64))).astype(np.int64)
    ideal = np.clip(ideal, 0, total)
    cuts = np.empty(n + 1, dtype=np.int64)
    cuts[0] = 0
    if n == 0:
        return cuts
    starts = np.cumsum(sizes) - sizes
    inner = ideal[:-1]
    j = np.searchsorted(starts, inner, side="right") - 1  # item holding each cut
    j = np.clip(j, 0, len(sizes) - 1)
    a = starts[j]
    s = sizes[j]
    o = inner - a
    snapped = (o + granularity // 2) // granularity * granularity
    snapped = np.minimum(snapped, s)
    small = s < small_bytes
    snapped = np.where(small, np.where(o * 2 <= s, 0, s), snapped)
    cuts[1:-1] = a + snapped
    cuts[-1] = total
    np.maximum.accumulate(cuts, out=cuts)
    return cuts


def _segments(starts: np.ndarray, sizes: np.ndarray,
              cuts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """For each segment ``k``: (item positions, offsets in item, lengths)."""
    ends = starts + sizes
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
    for k in range(len(cuts) - 1):
        lo, hi = int(cuts[k]), int(cuts[k + 1])
        if hi <= lo:
            out.append(None)
            continue
        j0 = int(np.searchsorted(ends, lo, side="right"))
        j1 = int(np.searchsorted(starts, hi, side="left"))
        idx = np.arange(j0, j1)
        off = np.maximum(lo - starts[idx], 0)
        end = np.minimum(hi - starts[idx], sizes[idx])
        out.append((idx, off, end - off))
    return out


# ---------------------------------------------------------------- placement
#
# The algorithm (FastPersist's second technique: a checkpoint's bytes divided
# evenly over every rank and every storage device, so a job writes at the sum
# of its devices' bandwidth instead of at the pace of its most loaded rank):
#
# 1. Items are grouped by their holder set (the ranks that hold them).  An
#    item held by one rank (a shard) stays with it: its bytes are that rank's
#    fixed load.
# 2. Holder sets of two or more ranks (DDP replicas, the replicated dimension
#    of HSDP or of a 2-D mesh) are processed smallest set first.  For each set
#    the balancer water-fills: it finds the level L at which
#    sum(max(0, L - load[r])) equals the set's bytes, so that the least loaded
#    holders take the most.  For nested or disjoint holder sets (every DCP
#    parallelism: DDP, FSDP, HSDP, TP x DP meshes) this is the optimal max
#    load.
# 3. The set's items are laid end to end in a virtual stream cut into
#    consecutive segments of the ranks' quotas (ranks in order).  A cut inside
#    an item moves to the nearest multiple of ``granularity`` from the item's
#    start (split items stay aligned for direct I/O and keep whole elements);
#    items smaller than ``small_bytes`` are never split: the cut moves to the
#    nearer item boundary.  The bytes actually assigned update the loads, so
#    later sets compensate.
# 4. Items whose size is unknown at plan time (bytes items: DCP does not give
#    their size before ``torch.save`` runs) and empty tensors are spread by
#    count: each goes to the holder with the fewest such items so far (then
#    the least bytes, then the lowest rank).
# 5. Devices: the ranks of one host, in rank order, form a stream of their
#    bytes, cut into ``n_dirs`` equal parts (a cut near a rank boundary moves
#    onto it, so that with as many ranks as devices each rank writes to one
#    device; otherwise cuts inside items are aligned as above).  Each rank
#    writes the bytes in part ``d`` to data directory ``d``.


@dataclasses.dataclass
class _Items:
    """Every rank's holdings concatenated in rank order, and the unique items
    (``order``, ``first``, ``nhold``)."""

    world: int
    ranks: np.ndarray  # per holding
    sizes: np.ndarray  # per holding
    rank_start: np.ndarray  # per rank: its first holding
    order: np.ndarray
    first: np.ndarray  # per item
    nhold: np.ndarray  # per item
    item_size: np.ndarray  # per item
    item_rank0: np.ndarray  # per item: the lowest holder
    item_order: np.ndarray  # per item: its plan position there (state-dict order)
    item_group: np.ndarray  # per item: its holder set (-1: one holder)
    group_ranks: list[np.ndarray]  # per holder set: its ranks

    def local(self, items: np.ndarray, rank: int, hset: np.ndarray) -> np.ndarray:
        """The plan positions on ``rank`` (a member of the holder set ``hset``) of ``items``."""
        pos = int(np.searchsorted(hset, rank))
        return self.order[self.first[items] + pos] - self.rank_start[rank]

    def by_holder_set(self, selected: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``selected`` items grouped by holder set, in item order within a
        set; smallest sets first (ties by their ranks), deterministically."""
        by_group = selected[np.lexsort((self.item_order[selected], self.item_group[selected]))]
        g_sorted = self.item_group[by_group]
        bounds = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
        chunks = [(int(g_sorted[b]), by_group[b:e]) for b, e in zip(bounds, np.r_[bounds[1:], len(by_group)])]
        chunks.sort(key=lambda c: (len(self.group_ranks[c[0]]), tuple(self.group_ranks[c[0]].tolist())))
        return chunks


def _index_items(holdings: Sequence[Holdings]) -> _Items:
    """The unique items of ``holdings`` (which hold at least one item);
    raises on an item listed twice by a rank or held with two sizes."""
    world = len(holdings)
    counts = np.array([len(h.keys) for h in holdings], dtype=np.int64)
    n_all = int(counts.sum())
    rank_start = np.cumsum(counts) - counts
    keys = np.concatenate([h.keys for h in holdings])
    sizes = np.concatenate([h.nbytes for h in holdings])
    ranks = np.repeat(np.arange(world, dtype=np.int32), counts)

    # Unique items, each item's holdings in rank order: one stable sort of
    # the keys (the holdings are concatenated in rank order).  Every pass
    # over these arrays counts at thousands of ranks: np.unique, lexsort or
    # a searchsorted per holding would each be slower.
    order = np.argsort(keys, kind="stable")
    keys_sorted = keys[order]
    new_item = np.empty(n_all, dtype=bool)
    new_item[0] = True
    np.not_equal(keys_sorted[1:], keys_sorted[:-1], out=new_item[1:])
    del keys_sorted
    first = np.flatnonzero(new_item)
    nhold = np.diff(np.r_[first, n_all])
    rank_s, size_s = ranks[order], sizes[order]
    same = ~new_item[1:]
    dup = np.flatnonzero(same & (rank_s[1:] == rank_s[:-1]))
    if len(dup):
        i = int(order[dup[0]])
        raise ValueError(
            f"rank {int(ranks[i])} lists item #{i - int(rank_start[ranks[i]])} (key {int(keys[i]):#x}) "
            f"twice in its plan"
        )
    bad = np.flatnonzero(same & (size_s[1:] != size_s[:-1]))
    if len(bad):
        i, k = int(order[bad[0]]), int(order[bad[0] + 1])
        raise ValueError(
            f"ranks {int(ranks[i])} and {int(ranks[k])} hold the same item (rank {int(ranks[i])}'s "
            f"item #{i - int(rank_start[ranks[i]])}) with different sizes ({int(sizes[i])} and "
            f"{int(sizes[k])} bytes): a replicated value must have the same shape and dtype on every rank"
        )
    del same, size_s
    item_rank0 = rank_s[first]
    item_group, group_ranks = _holder_sets(world, rank_s, nhold)
    return _Items(world, ranks, sizes, rank_start, order, first, nhold, sizes[order[first]], item_rank0,
                  order[first] - rank_start[item_rank0], item_group, group_ranks)


def _holder_sets(world: int, rank_s: np.ndarray, nhold: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each item's holder set (-1 for an item with one holder) and each
    set's ranks: a wrapping sum of per-rank random words, then checked
    exactly.  ``rank_s``: the holders, item by item; ``nhold``: per item."""
    multi_all = np.flatnonzero(nhold > 1)
    item_group = np.full(len(nhold), -1, dtype=np.int64)
    if not len(multi_all):
        return item_group, []
    rank_m = rank_s[np.repeat(nhold > 1, nhold)]
    nh = nhold[multi_all]
    first_m = np.cumsum(nh) - nh
    words = np.random.default_rng(0x5EED_FA57).integers(0, 2**63, world, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        sig = np.add.reduceat(words[rank_m], first_m) + nh.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    o = np.argsort(sig, kind="stable")
    new_group = np.empty(len(o), dtype=bool)
    new_group[0] = True
    sig_sorted = sig[o]
    np.not_equal(sig_sorted[1:], sig_sorted[:-1], out=new_group[1:])
    group_m = np.empty(len(o), dtype=np.int64)
    group_m[o] = np.cumsum(new_group) - 1
    rep = o[new_group]  # the first item of each group (positions in multi_all)
    item_m = np.repeat(np.arange(len(multi_all)), nh)
    rep_pos = first_m[rep[group_m[item_m]]] + (np.arange(len(rank_m)) - first_m[item_m])
    if not np.array_equal(rank_m[rep_pos], rank_m):
        raise RuntimeError("holder-set signature collision (report this as a bug in fp_dcp.save.balance)")
    item_group[multi_all] = group_m
    return item_group, [rank_m[first_m[r] : first_m[r] + nh[r]] for r in rep.tolist()]


_Parts = list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]  # per rank: (local items, offsets, lengths)


def _place_sized(it: _Items, gran: int, small: int) -> tuple[np.ndarray, _Parts]:
    """Steps 1 to 3 of the algorithm: each rank's load and pieces."""
    world = it.world
    loads = np.zeros(world, dtype=np.int64)
    parts: _Parts = [[] for _ in range(world)]
    sized = it.item_size > 0
    # 1. singletons: fixed loads
    single = sized & (it.nhold == 1)
    if single.any():
        # in holding order, i.e. by (rank, plan position): no sort needed
        mask = np.zeros(len(it.ranks), dtype=bool)
        mask[it.order[it.first[single]]] = True
        pos = np.flatnonzero(mask)
        owner_count = np.bincount(it.ranks[pos], minlength=world)
        ends = np.cumsum(owner_count)
        owners = np.flatnonzero(owner_count)
        loads[owners] += np.add.reduceat(it.sizes[pos], (ends - owner_count)[owners])
        for r in owners.tolist():
            p = pos[ends[r] - owner_count[r] : ends[r]]
            parts[r].append((p - it.rank_start[r], np.zeros(len(p), np.int64), it.sizes[p]))
    # 2. shared holder sets, smallest first: water-fill, then cut the stream
    multi = np.flatnonzero(sized & (it.nhold > 1))
    if len(multi):
        for g, items in it.by_holder_set(multi):
            hset = it.group_ranks[g]
            sz = it.item_size[items]
            quotas = water_fill(loads[hset], int(sz.sum()))
            cuts = cut_stream(sz, quotas, gran, small)
            starts = np.cumsum(sz) - sz
            for k, seg in enumerate(_segments(starts, sz, cuts)):
                if seg is None:
                    continue
                j, off, length = seg
                r = int(hset[k])
                loads[r] += int(length.sum())
                parts[r].append((it.local(items[j], r, hset), off, length))
    return loads, parts


def _place_unsized(it: _Items, loads: np.ndarray) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """Step 4: unsized (bytes) and empty items spread by count; per rank
    their count and (local item, size)."""
    unsized_counts = np.zeros(it.world, dtype=np.int64)
    rest = np.flatnonzero(~(it.item_size > 0))
    unsized_parts: list[list[tuple[int, int]]] = [[] for _ in range(it.world)]
    for u in rest[it.nhold[rest] == 1].tolist():  # held by one rank: that one
        r = int(it.item_rank0[u])
        unsized_counts[r] += 1
        unsized_parts[r].append((int(it.item_order[u]), int(it.item_size[u])))
    rest = rest[it.nhold[rest] > 1]
    if len(rest):
        for g, items in it.by_holder_set(rest):
            hset = it.group_ranks[g]
            rank_order = hset[np.lexsort((hset, loads[hset], unsized_counts[hset]))]
            for i, u in enumerate(items.tolist()):
                r = int(rank_order[i % len(rank_order)])
                unsized_counts[r] += 1
                pos = int(np.searchsorted(hset, r))
                unsized_parts[r].append((int(it.order[it.first[u] + pos] - it.rank_start[r]), int(it.item_size[u])))
    return unsized_counts, unsized_parts


def _place_devices(holdings: Sequence[Holdings], loads: np.ndarray, parts: _Parts,
                   unsized_parts: list[list[tuple[int, int]]], gran: int,
                   small: int) -> tuple[list[RankPieces], dict[str, np.ndarray]]:
    """Step 5: each host's bytes striped over its data directories; every
    rank's pieces and the bytes per device of each host."""
    hosts: dict[str, list[int]] = {}
    for h in holdings:
        hosts.setdefault(h.host, []).append(h.rank)
    pieces: dict[int, RankPieces] = {}
    device_loads: dict[str, np.ndarray] = {}
    for host, members in hosts.items():
        n_dirs = {holdings[r].n_dirs for r in members}
        if len(n_dirs) != 1:
            raise ValueError(
                f"the ranks on host {host} have different numbers of data directories {sorted(n_dirs)}: "
                f"give every rank of a host the same data_dirs"
            )
        (d,) = n_dirs
        rank_arrays = []
        for r in members:
            if parts[r]:
                loc = np.concatenate([p[0] for p in parts[r]])
                off = np.concatenate([p[1] for p in parts[r]])
                ln = np.concatenate([p[2] for p in parts[r]])
            else:
                loc = off = ln = np.zeros(0, np.int64)
            rank_arrays.append((loc, off, ln))
        devs, dloads = _stripe(rank_arrays, [int(loads[r]) for r in members], d, gran, small,
                               [holdings[r].nbytes for r in members])
        device_loads[host] = dloads
        for r, (loc, off, ln, dev, last_dev) in zip(members, devs):
            up = unsized_parts[r]
            if up:
                loc = np.concatenate([loc, np.array([p[0] for p in up], np.int64)])
                off = np.concatenate([off, np.zeros(len(up), np.int64)])
                ln = np.concatenate([ln, np.array([p[1] for p in up], np.int64)])
                dev = np.concatenate([dev, np.full(len(up), last_dev, np.int64)])
            pieces[r] = RankPieces(loc, off, ln, dev)
    return [pieces[r] for r in range(len(holdings))], device_loads


def plan_placement(holdings: Sequence[Holdings]) -> Placement:
    """Balance the bytes of every item over the ranks that hold it and over
    each host's data directories."""
    world = len(holdings)
    if world == 0:
        raise ValueError("no ranks")
    for r, h in enumerate(holdings):
        if h.rank != r:
            raise ValueError(f"holdings out of order: position {r} has rank {h.rank}")
    key = structure_key(holdings)
    if sum(len(h.keys) for h in holdings) == 0:
        empty = np.zeros(0, np.int64)
        return Placement(
            pieces=[RankPieces(empty, empty, empty, empty) for _ in holdings],
            loads=np.zeros(world, np.int64),
            device_loads={},
            unsized_counts=np.zeros(world, np.int64),
            items=0,
            total_bytes=0,
            key=key,
        )
    gran = max(h.granularity for h in holdings)
    small = max(h.small_bytes for h in holdings)
    it = _index_items(holdings)
    loads, parts = _place_sized(it, gran, small)
    unsized_counts, unsized_parts = _place_unsized(it, loads)
    pieces, device_loads = _place_devices(holdings, loads, parts, unsized_parts, gran, small)
    return Placement(
        pieces=pieces,
        loads=loads,
        device_loads=device_loads,
        unsized_counts=unsized_counts,
        items=len(it.first),
        total_bytes=int(it.item_size[it.item_size > 0].sum()),
        key=key,
    )


def _stripe(rank_arrays, rank_loads, n_dirs, gran, small, item_sizes):
    """Assign the sized pieces of one host's ranks to its ``n_dirs`` devices.
    Returns, per rank, ``(local, offset, length, device, device_of_its_end)``
    (pieces split at device boundaries) and the bytes per device."""
    if n_dirs == 1:
        out = [(loc, off, ln, np.zeros(len(loc), np.int64), 0) for loc, off, ln in rank_arrays]
        return out, np.array([sum(rank_loads)], dtype=np.int64)
    total = sum(rank_loads)
    rank_end = np.cumsum(rank_loads)
    rank_start = rank_end - np.asarray(rank_loads, dtype=np.int64)
    share = total / n_dirs
    tol = max(gran, share * 0.005)
    bounds = []
    for d in range(1, n_dirs):
        t = int(round(d * share))
        near = rank_end[np.abs(rank_end - t) <= tol]
        if len(near):
            bounds.append(int(near[np.argmin(np.abs(near - t))]))
            continue
        i = int(np.searchsorted(rank_end, t, side="right"))  # rank holding byte t
        i = min(i, len(rank_arrays) - 1)
        loc, off, ln = rank_arrays[i]
        pos = int(rank_start[i]) + np.cumsum(ln) - ln
        j = max(0, int(np.searchsorted(pos, t, side="right")) - 1)
        if len(ln) == 0:
            bounds.append(t)
            continue
        x = t - int(pos[j])  # bytes into piece j
        item_off = int(off[j]) + x
        if int(item_sizes[i][loc[j]]) < small:
            snapped = 0 if 2 * x <= int(ln[j]) else int(ln[j])
        else:
            snapped = min(max((item_off + gran // 2) // gran * gran - int(off[j]), 0), int(ln[j]))
        bounds.append(int(pos[j]) + snapped)
    bounds_arr = np.maximum.accumulate(np.array(bounds, dtype=np.int64))
    out = []
    dloads = np.zeros(n_dirs, dtype=np.int64)
    for (loc, off, ln), start in zip(rank_arrays, rank_start.tolist()):
        pos = start + np.cumsum(ln) - ln
        end = pos + ln
        # split the pieces that straddle a device boundary (last cut first,
        # so the positions of the pieces before it stay valid)
        for c in sorted({b for b in bounds_arr.tolist() if start < b < start + int(ln.sum())}, reverse=True):
            p = int(np.searchsorted(pos, c, side="right")) - 1
            if not pos[p] < c < end[p]:
                continue
            head = c - int(pos[p])
            loc = np.insert(loc, p + 1, loc[p])
            off = np.insert(off, p + 1, off[p] + head)
            ln = np.insert(ln, p + 1, ln[p] - head)
            ln[p] = head
            pos = start + np.cumsum(ln) - ln
            end = pos + ln
        dev = np.searchsorted(bounds_arr, pos, side="right").astype(np.int64)
        np.add.at(dloads, dev, ln)
        tail = start + int(ln.sum())
        last = int(np.searchsorted(bounds_arr, max(tail - 1, start), side="right"))
        out.append((loc, off, ln, dev, last))
    return out, dloads
