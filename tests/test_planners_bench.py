"""benchmarks/bench_save_load.py with fp_dcp's planners: the ``dcp_floor_fp``
row (DCP's own time with them, through a storage that moves no bytes), its
ceiling row, and ``--planners fp`` for the fp_dcp contenders."""

from __future__ import annotations

import pytest

from tests import _bench

bench = _bench.bench  # the fixture: benchmarks/bench_save_load.py as a module


def test_planner_kwargs_pick_our_planners_only_for_fp(bench):
    from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner

    assert bench._planner_kwargs(None) == {} and bench._planner_kwargs("dcp") == {}
    kw = bench._planner_kwargs("fp")
    assert type(kw["save"]["planner"]) is FastPersistSavePlanner
    assert type(kw["load"]["planner"]) is FastPersistLoadPlanner


def test_contenders_carry_the_planners(bench):
    args = bench.parse_args(["--contenders", "fp_dcp,dcp_floor,dcp_floor_fp", "--planners", "fp"])
    cs = {c["name"]: c for c in bench.build_contenders(args, True, "python")}
    assert cs["fp_dcp"]["planners"] == "fp" and cs["fp_dcp[noverify]"]["planners"] == "fp"
    assert cs["dcp_floor_fp"]["planners"] == "fp" and "planners" not in cs["dcp_floor"]
    default = bench.parse_args(["--contenders", "fp_dcp"])
    assert bench.build_contenders(default, True, "python")[0]["planners"] == "dcp"


def test_floor_and_fp_dcp_children_run_with_our_planners(bench, tmp_path):
    for kind in ("dcp_floor", "fp_dcp"):
        base = {"kind": kind, "path": str(tmp_path / kind), "mix": "small", "size_bytes": 2 << 20, "seed": 3,
                "planners": "fp"}
        for op in ("save", "load"):
            r = bench._child({**base, "op": op})
            assert r["ok"] and r["errors"] == [], r
            assert r["verified"] is (True if (kind, op) == ("fp_dcp", "load") else None)  # bit-exact load


def _runs(gbps):
    return [{"ok": True, "gbps": g, "rss_overhead_bytes": 1, "rss_base_bytes": 1, "cold": True} for g in gbps]


def test_ceiling_rows_for_both_planners(bench):
    contenders = [{"name": "fp_dcp", "kind": "fp_dcp", "role": "fp_dcp"},
                  {"name": "raw[hugebuf]", "kind": "raw", "role": "raw"},
                  {"name": "dcp_floor", "kind": "dcp_floor", "role": "dcp_floor"},
                  {"name": "dcp_floor_fp", "kind": "dcp_floor", "role": "dcp_floor", "planners": "fp"}]
    res = {"runs": {
        "fp_dcp": {"save": _runs([1.0]), "load": _runs([4.0])},
        "raw[hugebuf]": {"save": _runs([1.2]), "load": _runs([5.0])},
        "dcp_floor": {"save": _runs([8.0]), "load": _runs([10.0])},
        "dcp_floor_fp": {"save": _runs([24.0]), "load": _runs([45.0])},
    }}
    summ = bench._summaries(res, contenders)
    rows = {(r["op"], r["baseline"]): r for r in bench._ratios("small", summ, contenders) if r["contender"] == "fp_dcp"}
    assert rows[("load", "dcp_floor")]["ratio"] == pytest.approx(1 / (1 + 5.0 / 10.0))
    assert rows[("load", "dcp_floor_fp")]["ratio"] == pytest.approx(1 / (1 + 5.0 / 45.0))
    assert rows[("save", "dcp_floor_fp")]["ratio"] == pytest.approx(1 / (1 + 1.2 / 24.0))
    assert "fp_dcp's planners" in rows[("save", "dcp_floor_fp")]["vs"]


def test_simulated_coordinator_plans_with_both_planners_and_the_storage():
    """tools/plan_caching_time.py's simulation: both planners plan the same
    Metadata entries from the same local plans; with the storage's step,
    its plans carry what FastPersistWriter adds and the messages grow."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plan_caching_time.py")
    spec = importlib.util.spec_from_file_location("plan_caching_time", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    runs = {(kind, storage): tool.simulate(4, 10, kind, storage) for kind in ("dcp", "fp") for storage in (True, False)}
    assert {r["metadata_entries"] for r in runs.values()} == {11}  # ten tensors and the step
    for kind in ("dcp", "fp"):
        assert runs[kind, True]["gathered_mb"] > runs[kind, False]["gathered_mb"]
        assert runs[kind, True]["scattered_mb"] > runs[kind, False]["scattered_mb"]
    # --restart: the save's commit (every rank's results gathered, the layout checked to tile every
    # item, the metadata file encoded), decoded as a restarting rank does (it raises on a layout that
    # misses or repeats a byte), and DCP's results and pickled .metadata of the same save beside it
    restart = tool.simulate(4, 10, "fp", True, restart=True)
    assert restart["metadata_mb"] > 0 and restart["stock_metadata_mb"] > 0
    assert restart["results_mb"] > 0 and restart["stock_results_mb"] > 0
    for key in ("structure_encode_s", "results_gather_s", "commit_s", "metadata_decode_s", "stock_results_gather_s",
                "stock_commit_s", "stock_metadata_load_s"):
        assert restart[key] > 0, key
