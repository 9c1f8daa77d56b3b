"""fp_dcp.coverage: whether stored chunks overlap or miss part of a tensor,
against painting every element of small tensors."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp_dcp import coverage

_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _painted(size, chunks) -> np.ndarray:
    """How many chunks hold each element."""
    count = np.zeros(size, dtype=np.int64)
    for off, n in chunks:
        count[tuple(slice(o, o + k) for o, k in zip(off, n))] += 1
    return count


@st.composite
def _boxes(draw):
    """A tensor's size and in-bounds chunks: a grid (even or not, each cell
    kept, dropped, repeated or moved by one), bricks (rows cut at different
    columns) or boxes anywhere."""
    nd = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(st.integers(0, 5), min_size=nd, max_size=nd)))
    kind = draw(st.sampled_from(["grid", "bricks", "any"]))
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if kind == "grid" or (kind == "bricks" and nd < 2):
        cuts = [sorted({0, s} | set(draw(st.lists(st.integers(0, s), max_size=3)))) for s in size]
        cells = [[(a, b - a) for a, b in zip(c, c[1:])] or [(0, 0)] for c in cuts]
        for cell in np.ndindex(*[len(c) for c in cells]) if nd else [()]:
            off = tuple(cells[d][i][0] for d, i in enumerate(cell))
            n = tuple(cells[d][i][1] for d, i in enumerate(cell))
            action = draw(st.integers(0, 9))
            if action == 0:
                continue  # a hole
            chunks.append((off, n))
            if action == 1:
                chunks.append((off, n))  # stored twice
            elif action == 2 and nd:
                d = draw(st.integers(0, nd - 1))
                o = list(off)
                o[d] = max(0, min(size[d] - n[d], o[d] + draw(st.sampled_from([-1, 1]))))
                chunks[-1] = (tuple(o), n)  # moved by one (still inside)
    elif kind == "bricks":
        for row in range(size[0]):  # each row cut along the second dimension at its own places
            cols = sorted({0, size[1]} | set(draw(st.lists(st.integers(0, size[1]), max_size=3))))
            for a, b in zip(cols, cols[1:]):
                chunks.append(((row, a) + (0,) * (nd - 2), (1, b - a) + size[2:]))
        if chunks and draw(st.booleans()):
            chunks.append(draw(st.sampled_from(chunks)))
    else:
        for _ in range(draw(st.integers(0, 8))):
            off = tuple(draw(st.integers(0, s)) for s in size)
            n = tuple(draw(st.integers(0, s - o)) for s, o in zip(size, off))
            chunks.append((off, n))
    return size, draw(st.permutations(chunks))


def _all_covered(size, chunks) -> bool:
    """:func:`coverage.all_covered` of one tensor, as the decoders give it: columns."""
    def col(values):
        return np.array(list(values), dtype=np.int64)

    return coverage.all_covered(col([len(size)]), col(size), col([len(chunks)]),
                                col(v for o, _ in chunks for v in o), col(v for _, n in chunks for v in n))


@_SETTINGS
@given(_boxes())
def test_overlap_and_uncovered_agree_with_painting(case):
    size, chunks = case
    count = _painted(size, chunks)
    assert coverage.overlap(chunks) == bool((count > 1).any())
    exact = bool((count == 1).all())
    assert (coverage.uncovered(size, chunks) is None) == exact
    assert _all_covered(size, chunks) == exact


def test_overlap_of_many_shards_takes_each_layout_whole():
    """A thousand FSDP shards, a 32 x 32 mesh's uneven grid, and the same
    grid with one cell stored twice (every rank of a restart decodes every
    tensor's chunks)."""
    rows = [(i * 3 + min(i, 5), 3 + (i < 5)) for i in range(1000)]
    assert not coverage.overlap([((r, 0), (n, 8)) for r, n in rows])
    grid = [((r, c * 2), (n, 2)) for r, n in rows[:32] for c in range(32)]
    assert not coverage.overlap(grid)
    assert coverage.overlap(grid + [grid[517]])
    assert coverage.uncovered((rows[31][0] + rows[31][1], 64), grid) is None
    assert coverage.overlap([((0, 0), (4, 4)), ((3, 3), (1, 1))])
    # neither ordered by one dimension nor a grid: swept, the overlap two chunks apart in the sweep's order
    assert coverage.overlap([((0, 0), (3, 1)), ((1, 1), (1, 1)), ((2, 0), (1, 1))])
    assert not coverage.overlap([((0, 0), (3, 1)), ((1, 1), (1, 1)), ((2, 1), (1, 1))])


def _columns_and_rows(n: int) -> tuple[tuple[int, int], list]:
    """A 2n x 2n tensor cut into n tall columns (the left half) and 2n rows of
    the right half: disjoint, exactly covered, yet no dimension orders the
    chunks and no grid holds them, and every column shares the first
    dimension's band with every other chunk."""
    cols = [((0, i), (2 * n, 1)) for i in range(n)]
    rows = [((j, n), (1, n)) for j in range(2 * n)]
    return (2 * n, 2 * n), cols + rows


def test_a_sweep_past_its_budget_is_refused_not_run(monkeypatch):
    size, chunks = _columns_and_rows(6)
    assert not coverage.overlap(chunks) and coverage.uncovered(size, chunks) is None
    monkeypatch.setattr(coverage, "MAX_SWEPT_PAIRS", 20)  # the sweep would compare 87 pairs
    try:
        coverage.overlap(chunks)
    except coverage.CheckTooLarge as e:
        assert "18 chunks that no dimension orders and no grid holds, 87 pairs" in str(e)
    else:
        raise AssertionError("the sweep ran past its budget")
    assert "refused rather than checked" in coverage.uncovered(size, chunks)
    assert not _all_covered(size, chunks)
