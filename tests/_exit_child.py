"""One rank of a 2-rank gloo job that saves with fp_dcp, ends with a
collective whose tensors Python drops first, destroys its process group and
exits: ``python -m tests._exit_child RENDEZVOUS_FILE RANK CKPT``.

The exit is made the worst case for torch's gloo worker threads: every thread
of the process on one CPU, the workers at the idle scheduling class (they run
only while the main thread waits), the process group still referenced (as a
DeviceMesh or a DTensor keeps it), and the main thread blocking once while the
interpreter finalizes (as closing a file or joining a thread does).  A worker
that takes the GIL to drop the collective's tensors only then aborts the
process (fp_dcp/_exit.py).  Prints ``rank R done`` before it exits."""

from __future__ import annotations

import os
import sys
import time


def starve_gloo_workers() -> None:
    """Every thread on one CPU, torch's gloo worker threads SCHED_IDLE."""
    cpu = min(os.sched_getaffinity(0))
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {cpu})
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


class _BlocksWhileFinalizing:
    def __del__(self) -> None:
        time.sleep(0.2)


def main(rendezvous: str, rank: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dcp.save({"w": torch.arange(1024.0)}, storage_writer=FastPersistWriter(ckpt))
    starve_gloo_workers()
    t = torch.ones(1024)
    dist.all_reduce(t)
    del t  # the worker that ran the all-reduce now holds its tensor's last reference
    globals()["_group"] = dist.group.WORLD
    dist.destroy_process_group()
    globals()["_last"] = _BlocksWhileFinalizing()  # dropped while the interpreter finalizes
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
