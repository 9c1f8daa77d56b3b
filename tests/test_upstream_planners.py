"""PyTorch's own DCP tests, run with fp_dcp's planners (and storage) where
they use DCP's defaults.

PyTorch's test files are not part of this repository: point
``DCP_UPSTREAM_TESTS`` at a PyTorch checkout's
``test/distributed/checkpoint`` (of the torch release installed, or near it)
and this module runs the files of :data:`FILES` found there, each three
times in its own pytest process (``tests/upstream/swap.py``):

- ``stock``: as they are (the reference: a test can fail on a torch release
  other than its own, or for want of CUDA);
- ``planners``: fp_dcp's planners wherever the test gets DCP's default ones,
  named or through ``dcp.save`` / ``dcp.load`` without ``planner=``;
- ``storage``: the same, and fp_dcp's writer and reader wherever the test
  gets ``FileSystemWriter`` / ``FileSystemReader``.

Every test that passes stock must pass swapped, or be listed in
``swap.KNOWN`` (skipped, with the reason) or ``swap.DIFFERENCES`` (an
expected failure, strict).  Without ``DCP_UPSTREAM_TESTS`` these tests
skip; the scenarios of those files are also written out in
``tests/test_upstream_scenarios.py``, which runs everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.upstream import swap

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "tests" / "upstream" / "site"
ENV = "DCP_UPSTREAM_TESTS"

# PyTorch's DCP test files that save or load through a planner DCP makes
# or that the test names (DefaultSavePlanner / DefaultLoadPlanner), and run
# on the CPU; seconds each stock run takes here (2 cores), for the timeout
FILES = {
    "test_planner.py": 120,
    "test_checkpoint.py": 300,
    "test_file_system_checkpoint_cpu.py": 600,
    "test_file_system_checkpoint.py": 600,
    "test_dtensor_resharding.py": 900,
    "test_save_load_api.py": 300,
    "test_dtensor_checkpoint.py": 600,
    "test_tp_checkpoint.py": 600,
    "test_hsdp_checkpoint.py": 600,
    "test_fsdp_model_state.py": 600,
    "test_fsdp_optim_state.py": 600,
    "test_state_dict.py": 900,
    "e2e/test_e2e_save_and_load.py": 900,
}

pytestmark = pytest.mark.upstream


def _upstream_dir() -> Path:
    where = os.environ.get(ENV)
    if not where:
        pytest.skip(f"{ENV} is not set: PyTorch's test/distributed/checkpoint is not here")
    path = Path(where)
    if not path.is_dir():
        pytest.fail(f"{ENV}={where}: no such directory")
    return path


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, message) from a JUnit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = ((found.get("message") or "").splitlines() or [""])[0][:300]
                break
        previous = result.get(name)
        if previous is None or previous[0] == "passed":  # a teardown error is a second entry
            result[name] = (outcome, message)
    return result


def run_file(directory: Path, name: str, mode: str, out: Path, timeout: float) -> dict[str, tuple[str, str]]:
    """Run one upstream file with fp_dcp swapped in as ``mode``; its outcomes."""
    junit = out / f"{mode}-{name.replace('/', '_')}.xml"
    env = dict(os.environ, **{swap.ENV: mode})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", str(directory),
           "-p", "no:cacheprovider", "-p", "tests.upstream.swap", f"--junitxml={junit}",
           "--timeout", str(int(timeout)), str(directory / name)]
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout + 60)
    if not junit.exists():
        raise AssertionError(f"{name} ({mode}) ran no test (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")
    return _outcomes(junit)


_stock: dict[str, dict[str, tuple[str, str]]] = {}


@pytest.mark.slow
@pytest.mark.timeout(3 * max(FILES.values()) + 300)
@pytest.mark.parametrize("mode", ["planners", "storage"])
@pytest.mark.parametrize("name", list(FILES))
def test_upstream_file_passes_with_fp_dcp_swapped_in(name, mode, tmp_path_factory):
    directory = _upstream_dir()
    if not (directory / name).is_file():
        pytest.skip(f"{name} is not in {directory}")
    pytest.importorskip("expecttest", reason="PyTorch's test helpers need expecttest")
    out = tmp_path_factory.mktemp("upstream")
    if name not in _stock:
        _stock[name] = run_file(directory, name, "stock", out, FILES[name])
    stock = _stock[name]
    if not any(o == "passed" for o, _ in stock.values()):
        pytest.skip(f"{name}: no test passes here even with DCP's own classes (CUDA, another torch release)")
    ours = run_file(directory, name, mode, out, FILES[name])
    lost = {}
    for test, (outcome, _) in stock.items():
        got, message = ours.get(test, ("missing", ""))
        excused = got == "skipped" and ("inspects DCP's own" in message or "known difference" in message)
        if outcome == "passed" and got != "passed" and not excused:
            lost[test] = f"{got}: {message}"
    counts = {k: sum(1 for o, _ in ours.values() if o == k) for k in ("passed", "failed", "skipped")}
    stock_counts = {k: sum(1 for o, _ in stock.values() if o == k) for k in ("passed", "failed", "skipped")}
    print(f"{name} [{mode}]: stock {stock_counts}, fp_dcp {counts}")
    assert not lost, f"{name}: passes with DCP's defaults, not with fp_dcp's ({mode}):\n" + "\n".join(
        f"  {t}: {m}" for t, m in sorted(lost.items()))


_PROBE = """
import os, sys, torch, warnings
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner, state_dict_loader, state_dict_saver
from fp_dcp._dcp_hooks import checkpoint_kind
warnings.simplefilter("ignore")
print(dcp.DefaultSavePlanner.__name__, default_planner.DefaultLoadPlanner.__name__,
      state_dict_saver.DefaultSavePlanner.__name__, state_dict_loader.DefaultLoadPlanner.__name__)
sd = {"w": torch.arange(12.0).view(3, 4) / 7, "step": 3}
path = sys.argv[1]
dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
back = {"w": torch.zeros(3, 4), "step": 0}
dcp.load(back, storage_reader=dcp.FileSystemReader(path))
print(checkpoint_kind(path), torch.equal(back["w"], sd["w"]), back["step"])
"""


_OURS = "FastPersistSavePlanner FastPersistLoadPlanner FastPersistSavePlanner FastPersistLoadPlanner"


@pytest.mark.parametrize("mode,names,kind", [
    pytest.param("stock", _OURS.replace("FastPersist", "Default"), "stock", id="stock", marks=pytest.mark.slow),
    pytest.param("planners", _OURS, "stock", id="planners", marks=pytest.mark.slow),
    pytest.param("storage", _OURS, "fp_dcp", id="storage"),
])
def test_swap_installs_what_each_mode_says_in_a_fresh_interpreter(tmp_path, mode, names, kind):
    """What the runner's rank processes get: ``sitecustomize`` swaps fp_dcp
    in from the environment alone, before the test imports anything; a
    checkpoint made through the names PyTorch's tests use round-trips."""
    env = dict(os.environ, **{swap.ENV: mode})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SITE)])
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "ckpt")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [names, f"{kind} True 3"], out.stdout + out.stderr[-3000:]


def test_swap_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="DCP_UPSTREAM_SWAP='planner': use one of stock, planners, storage"):
        swap.install("planner")
