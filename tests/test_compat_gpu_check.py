"""benchmarks/gpu_check.py --dry-run: the GPU check's every step, end to end,
with CPU tensors standing in at small sizes (so the one command prepared for
a GPU machine keeps working)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 10 s of CPU: the whole suite runs it
def test_gpu_check_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    # --no-build: the extension this suite imports is the one in place
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--no-build",
                        "--async-saves", "2", "--out", str(out), "--work", str(work)],
                       capture_output=True, text=True, env=env, timeout=400, stdin=subprocess.DEVNULL,
                       cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["dry_run"] and data["device"] == "cpu" and not data["failed"] and not data["skipped"]
    steps = data["steps"]
    for name in ("big", "small"):
        for step in ("make", "copy_ceiling", "save_load", "async"):
            assert f"{name}.{step}" in steps, (name, step)
        sl, a = steps[f"{name}.save_load"], steps[f"{name}.async"]
        assert sl["fp_dcp_load"]["bit_exact"] and sl["stock_load"]["bit_exact"]
        assert a["eager_load"]["bit_exact"] and a["lazy_load"]["bit_exact"]
        for row in a["lazy"]:  # every save of a lazy writer measured as one (the first pays for the arena)
            assert row["staged_s"] >= row["returned_s"] >= 0
        assert len(a["lazy"]) == len(a["eager"]) == 2
    # the small state through fp_dcp's planners too, and the peer where it is installed
    small_sl, small_a = steps["small.save_load"], steps["small.async"]
    assert small_sl["fp_dcp_planners_load"]["bit_exact"] and small_a["lazy_planners_load"]["bit_exact"]
    assert all(r["staged_s"] >= r["returned_s"] >= 0 for r in small_a["lazy_planners"])
    for name in ("big", "small"):
        peer = steps[f"{name}.peer"]
        assert peer.get("skipped") or peer["load"]["bit_exact"], peer
    assert steps["small.make"]["tensors"] == 200
    # the CUDA tests were selected (collected only, on the CPU)
    assert steps["tests"]["returncode"] == 0 and "collected" in steps["tests"]["summary"]
    assert not steps["tests"]["summary"].startswith("0/")
    assert steps["disk"]["hugebuf"]["bytes"] > 0
    cpu = steps["disk"]["cpu_tensor_in_place"]
    assert cpu["bit_exact"] and cpu["bytes"] == 64 << 20
    past = cpu["source_past_page"]  # in place where the file system takes the tensor's address
    assert cpu["zero_copy_bytes"] == (cpu["bytes"] if past % cpu["memory_alignment"] == 0 else 0)
    assert "fp_dcp save" in r.stdout and "lazy async #1 staged" in r.stdout  # the table
    assert work.is_dir() and not any(work.iterdir())  # the run's own checkpoints removed, nothing else
