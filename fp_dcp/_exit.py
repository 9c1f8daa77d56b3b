"""At interpreter exit, let torch's gloo worker threads finish first.

A gloo worker thread (``pt_gloo_runloop``) that ends a collective drops the
collective's tensors, and takes the GIL to do it when Python dropped them
first (the tensors of ``all_gather_object``, DCP's plan exchanges, a DTensor
redistribution).  A worker that gets the GIL only after the interpreter began
to finalize is ended by CPython (before 3.14) with ``pthread_exit``, whose
unwinding through torch's ``noexcept`` destructor calls ``std::terminate``:
the process aborts at exit ("terminate called without an active exception",
SIGABRT) after all its work succeeded.  It happens when the worker runs late
(a loaded machine), the collective is among the last before exit, and the
process group outlives ``destroy_process_group`` (a DeviceMesh or a DTensor
keeps it; a process group freed joins its workers first) or is never
destroyed.

:func:`install` (called when fp_dcp makes engines) adds an exit hook that,
before the interpreter finalizes, waits with the GIL released until every
gloo worker thread of the process sleeps on its empty queue, for at most
:data:`WAIT_SECONDS`: a worker busy in a collective that does not end (a peer
that is gone) is left as it is.  Linux only (``/proc/self/task``), and only with a
torch that names the workers (2.11 and later); elsewhere the hook does nothing."""

from __future__ import annotations

import atexit
import os
import platform
import threading
import time

__all__ = ["install", "gloo_workers_idle", "wait_for_gloo_workers", "WAIT_SECONDS"]

WAIT_SECONDS = 2.0
_POLL_SECONDS = 0.001
_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
# the futex system call's number, by machine: an idle worker waits in it
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_CMD_MASK = 0x7F  # the operation without FUTEX_PRIVATE_FLAG / FUTEX_CLOCK_REALTIME
_FUTEX_WAITS = (0, 9)  # FUTEX_WAIT, FUTEX_WAIT_BITSET (a condition variable's wait)

_installed = False
_lock = threading.Lock()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended meanwhile
        return None


def _idle(task: str) -> bool:
    """Whether the thread at ``task`` (a /proc task directory) sleeps in a
    futex wait without a timeout: a worker waiting for work.  A worker that
    runs, waits to run, or waits for the GIL (a wait with a timeout) is not."""
    stat = _read(task + "/stat")
    if stat is None:
        return True
    if stat.rsplit(")", 1)[-1].split()[0] != "S":
        return False
    call = (_read(task + "/syscall") or "").split()
    if len(call) < 5 or call[0] != str(_FUTEX):
        return False
    return int(call[2], 16) & _FUTEX_CMD_MASK in _FUTEX_WAITS and int(call[4], 16) == 0


def gloo_workers_idle() -> bool:
    """Whether every gloo worker thread of this process waits for work (True
    where there is none, or off Linux)."""
    if _FUTEX is None:
        return True
    root = "/proc/self/task"
    try:
        tasks = os.listdir(root)
    except OSError:
        return True
    for tid in tasks:
        task = f"{root}/{tid}"
        if (_read(task + "/comm") or "").strip() == _WORKER_NAME and not _idle(task):
            return False
    return True


def wait_for_gloo_workers(timeout: float = WAIT_SECONDS) -> bool:
    """Sleep (the GIL released) until every gloo worker thread has been seen
    waiting for work twice in a row, or ``timeout`` seconds; whether they were."""
    deadline = time.monotonic() + timeout
    seen = 0
    while True:
        seen = seen + 1 if gloo_workers_idle() else 0
        if seen >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)


def _at_exit() -> None:
    import sys

    if "torch.distributed" in sys.modules:  # no gloo worker without it
        wait_for_gloo_workers()


def install() -> None:
    """Add the exit hook once per process."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(_at_exit)
            _installed = True
