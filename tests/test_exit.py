"""A gloo rank that used fp_dcp exits with status 0: torch's gloo worker
threads finish dropping their last collective's tensors before the
interpreter finalizes (fp_dcp/_exit.py), instead of aborting the process
("terminate called without an active exception", SIGABRT)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp_dcp import _exit
from tests._dist import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore"}
_ABORT = "terminate called without an active exception"


def _job(tmp: str) -> list[tuple[int, str, str]]:
    """Run the 2 ranks of tests/_exit_child.py; (status, stdout, stderr) of each."""
    ranks = [subprocess.Popen([sys.executable, "-m", "tests._exit_child", os.path.join(tmp, "rendezvous"), str(r),
                               os.path.join(tmp, "ckpt")], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outs)]


@pytest.mark.slow  # 4 jobs of 2 fresh processes each: about 40 s on 2 busy cores
def test_a_rank_whose_gloo_worker_is_late_exits_cleanly(tmp_path):
    """Without the exit hook most of these jobs abort at exit (a rank's
    status -6); 4 in a row, all clean, with every rank's work done."""
    for attempt in range(4):
        tmp = tmp_path / str(attempt)
        tmp.mkdir()
        for rank, (status, out, err) in enumerate(_job(str(tmp))):
            assert _ABORT not in err, f"job {attempt} rank {rank} aborted at exit:\n{err[-3000:]}"
            assert status == 0, f"job {attempt} rank {rank} exited {status}:\n{out[-2000:]}\n{err[-3000:]}"
            assert out.strip().endswith(f"rank {rank} done"), out


def _workers_after_a_collective(rank: int, world_size: int) -> tuple[int, bool]:
    import torch
    import torch.distributed as dist

    t = torch.ones(64)
    dist.all_reduce(t)
    del t
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names.count(_exit._WORKER_NAME), _exit.wait_for_gloo_workers(timeout=60.0)


def test_the_hook_finds_this_torchs_gloo_workers_and_sees_them_go_idle():
    """The hook knows gloo's worker threads by name: the installed torch must
    still give them that name, or the hook would wait for nothing."""
    import torch

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 11):
        pytest.skip(f"torch {torch.__version__} leaves gloo's worker threads unnamed: the exit hook cannot "
                    "tell them apart (nothing waits at exit)")
    for count, idle in run_ranks(2, _workers_after_a_collective):
        assert count >= 1 and idle


def test_no_gloo_worker_is_no_wait():
    """A process without gloo workers is seen idle at once (no wait at exit)."""
    assert _exit.gloo_workers_idle()
    assert _exit.wait_for_gloo_workers(timeout=60.0)
