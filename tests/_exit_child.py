"""One rank of a 2-rank gloo job that saves with fp_dcp, ends with a
collective whose tensors Python drops first (on the process group it keeps
after destroying it) and exits:
``python -m tests._exit_child RENDEZVOUS_FILE RANK CKPT``.

Its exit is the worst case for torch's gloo worker threads, made to happen
every time: every thread of the process on one CPU and the workers at the idle
scheduling class (they run only while the main thread waits); the worker that
ran the last collective held (a signal whose handler is ``pause``) from the
moment it wakes the main thread until the script's last line, so that it
drops the collective's tensors late; the process group still referenced (as a
DeviceMesh or a DTensor keeps it); and the main thread blocking once while the
interpreter finalizes (as closing a file or joining a thread does).  A worker
that gets the GIL only then aborts the process (fp_dcp/_exit.py).  Prints
``rank R done`` first."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)
_HOLD, _GO = signal.SIGUSR1, signal.SIGUSR2


def gloo_workers() -> list[int]:
    tids = []
    for tid in map(int, os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                tids.append(tid)
    return tids


def starve_gloo_workers() -> None:
    """Every thread on one CPU, torch's gloo worker threads SCHED_IDLE; a gloo
    worker sent ``_HOLD`` waits (in ``pause``) until it is sent ``_GO``."""
    _libc.signal.restype = ctypes.c_void_p
    _libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _libc.signal(_HOLD, ctypes.cast(_libc.pause, ctypes.c_void_p))
    _libc.signal(_GO, ctypes.cast(_libc.getpid, ctypes.c_void_p))  # a handler that does nothing
    cpu = min(os.sched_getaffinity(0))
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {cpu})
    for tid in gloo_workers():
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def signal_gloo_workers(sig: int, taken: bool = True) -> None:
    """Send ``sig`` to every gloo worker; with ``taken``, return once each has
    taken it (this thread sleeps meanwhile: the workers run)."""
    tids = gloo_workers()
    for tid in tids:
        if _libc.tgkill(os.getpid(), tid, sig) != 0:
            raise OSError(ctypes.get_errno(), f"tgkill {tid}")
    bit = 1 << (sig - 1)
    for tid in tids if taken else []:
        while True:
            with open(f"/proc/self/task/{tid}/status") as f:
                pending = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigPnd:"))
            if not pending & bit:
                break
            time.sleep(0.001)  # the worker runs while this thread waits


class _BlocksWhileFinalizing:
    def __del__(self, sleep=time.sleep) -> None:  # bound now: the module's names are gone by then
        sleep(0.2)


def main(rendezvous: str, rank: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dcp.save({"w": torch.arange(1024.0)}, storage_writer=FastPersistWriter(ckpt))
    group = dist.group.WORLD
    globals()["_group"] = group  # as a DeviceMesh or a DTensor keeps it
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    starve_gloo_workers()
    t = torch.ones(1024)
    group.allreduce([t]).wait()
    signal_gloo_workers(_HOLD)  # taken before the worker that woke this thread runs on
    del t  # that worker now holds the tensor's last reference
    globals()["_last"] = _BlocksWhileFinalizing()  # dropped while the interpreter finalizes
    signal_gloo_workers(_GO, taken=False)  # runnable again, but runs only when this thread waits


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
