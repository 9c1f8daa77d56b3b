"""Multi-rank tests: run a function on N gloo processes on the CPU.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` fresh processes
(forkserver: no inherited thread pools), joins them into a gloo process group
(or ``backend=``'s; with NCCL each rank first takes the GPU of its rank)
through a file rendezvous (no fixed port), calls ``fn(rank, world_size,
*args)`` on each, and returns the list of their return values.  Any rank that
raises, exits non-zero or outlives ``timeout`` fails the test with that rank's
traceback — no background worker goes unchecked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(rank)  # a draw without its own generator is the same every run (see conftest.py)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0, backend: str = "gloo") -> list[Any]:
    # forkserver: fresh processes (no thread pools inherited from pytest's),
    # forked from a server that has imported torch once.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "fp_dcp", "tests._dist"])
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue, backend), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            for _ in range(world_size):
                try:
                    rank, ok, value = queue.get(timeout=timeout)
                except Exception:  # queue.Empty: a rank hung or died silently
                    break
                (results if ok else failures)[rank] = value
                if failures:
                    break  # the others may now hang in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if failures or len(results) < world_size else timeout)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            rank = min(failures)
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise AssertionError(f"ranks {missing} returned nothing (exit codes {codes}; timeout {timeout}s)")
        bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise AssertionError(f"ranks exited non-zero: {bad}")
        return [results[r] for r in range(world_size)]
