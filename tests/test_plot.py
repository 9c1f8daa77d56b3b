"""benchmarks/plot.py: the figures of bench_save_load.py JSON as a Markdown
table (ratios to the device's best raw contender) and a PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plot_module():
    spec = importlib.util.spec_from_file_location("fp_dcp_bench_plot", os.path.join(REPO, "benchmarks", "plot.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(role, save, load, cold=True):
    return {"save": {"n": 3, "median": save, "role": role, "cold": None},
            "load": {"n": 3, "median": load, "role": role, "cold": cold if role != "raw" else None}}


def _report(tmp_path):
    report = {
        "benchmark": "save_load", "timestamp": "20260101-000000", "argv": ["--size", "4GiB"],
        "hardware": {"fs_type": "ext4", "cpu_cores": 2, "block_device": {"disk": "vda", "rotational": "0"}},
        "contenders": [{"name": "fp_dcp", "role": "fp_dcp"}, {"name": "stock", "role": "stock"},
                       {"name": "raw[python,4M]", "role": "raw"}, {"name": "raw[hugebuf]", "role": "raw"}],
        "mixes": [{"mix": "large", "payload_bytes": 4 << 30, "tensors": 64, "objects": 1, "summary": {
            "fp_dcp": _summary("fp_dcp", 4.0, 3.0),
            "stock": _summary("stock", 0.5, 1.0),
            "raw[python,4M]": _summary("raw", 1.0, 1.5),
            "raw[hugebuf]": _summary("raw", 5.0, 4.0),
        }}],
    }
    path = tmp_path / "save_load-x.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_table_has_every_contender_against_the_device_best(tmp_path):
    plot = _plot_module()
    md = plot.markdown(plot.load_profiles([_report(tmp_path)]))
    rows = [ln for ln in md.splitlines() if ln.startswith("| ext4")]
    assert len(rows) == 3
    assert "| fp_dcp | 4.00 | 0.80x | 3.00 | 0.75x |" in rows[0]
    assert "| stock | 0.50 | 0.10x | 1.00 | 0.25x |" in rows[1]
    assert "**device best** (raw: write raw[hugebuf], read raw[hugebuf]) | 5.00 | 1.00x | 4.00 | 1.00x |" in rows[2]
    assert rows[0].startswith("| ext4 on vda (SSD), 2 cores: large tensors, 4 GiB |")
    assert "`python benchmarks/bench_save_load.py --size 4GiB`" in md


def test_png_and_table_beside_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _plot_module()
    path = _report(tmp_path)
    assert plot.main([path]) == 0
    png = tmp_path / "save_load-x.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (tmp_path / "save_load-x.md").read_text().startswith("| device profile |")


def test_without_matplotlib_the_table_is_written_and_the_fix_named(tmp_path, monkeypatch, capsys):
    plot = _plot_module()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = _report(tmp_path)
    assert plot.main([path, "--out", str(tmp_path / "o" / "speed")]) == 1
    assert (tmp_path / "o" / "speed.md").exists() and not (tmp_path / "o" / "speed.png").exists()
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err
    assert plot.main([str(tmp_path / "missing.json")]) == 2
