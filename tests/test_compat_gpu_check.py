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
    cpu = steps["cpu_tensor_in_place"]
    assert cpu["bytes"] == 64 << 20 and cpu["default"]["bit_exact"]
    past = cpu["source_past_page"]  # in place where the file system takes the tensor's address
    in_place = past % cpu["memory_alignment"] == 0
    assert cpu["default"]["zero_copy_bytes"] == (cpu["bytes"] if in_place else 0)
    if in_place:  # and timed through the bounce buffers too
        assert cpu["bounced"]["bit_exact"] and cpu["bounced"]["zero_copy_bytes"] == 0
    else:
        assert "bounced" not in cpu
    assert "fp_dcp save" in r.stdout and "lazy async #1 staged" in r.stdout  # the table
    assert work.is_dir() and not any(work.iterdir())  # the run's own checkpoints removed, nothing else


def test_gpu_check_times_a_cpu_tensor_in_place_and_bounced(tmp_path, monkeypatch):
    """Where the file system takes O_DIRECT memory 64 bytes past a page (as
    NVMe does; emulated here by tmpfs, which takes any address, and a probe
    that says 64), the step saves and loads the tensor in place, then again
    through the bounce buffers, each bit-exact."""
    import importlib.util
    import shutil
    import tempfile

    from fp_dcp import _native

    if not _native.direct_io_supported("/dev/shm"):
        pytest.skip("this tmpfs refuses O_DIRECT")
    spec = importlib.util.spec_from_file_location("gpu_check_in_place", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(_native, "probe_alignment", lambda path: (64, 4096))
    work = tempfile.mkdtemp(prefix="fp_dcp_test_", dir="/dev/shm")
    try:
        r = gpu_check.cpu_tensor_in_place(gpu_check.Path(work), 8 << 20)
    finally:
        shutil.rmtree(work)
    assert r["memory_alignment"] == 64 and r["source_past_page"] % 64 == 0
    assert r["default"]["zero_copy_bytes"] == r["default"]["direct_bytes"] == 8 << 20
    assert r["bounced"]["zero_copy_bytes"] == r["bounced"]["direct_bytes"] == 0
    assert r["default"]["bit_exact"] and r["bounced"]["bit_exact"]
    assert "in place 8 / 8 MiB) load" in gpu_check.table({"steps": {"cpu_tensor_in_place": r}})
