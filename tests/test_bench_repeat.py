"""benchmarks/bench_repeat.py runs as documented: every contender saves
through a new writer each time, and the table reports each of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_repeat_quick_reports_every_contender(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_repeat.py"), "--quick",
                        "--interval", "0", "--dir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("fp_dcp", "fp_dcp[keep 0]", "stock", "raw"):
        assert f"\n{name} " in r.stdout
    run = json.loads(out.read_text())["runs"]["bare"]
    assert all(len(v) == 3 for v in run["times"].values())
    assert set(run["engine_wait"]) == {"fp_dcp", "fp_dcp[keep 0]"}
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())
