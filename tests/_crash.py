"""Crash consistency: save in child processes and SIGKILL them at chosen
points of the save's timeline, then check what is left on disk.

Shared by ``tests/test_faults.py`` (a sample of points) and
``benchmarks/torture.py`` (all of them).  A *point* is one of

* ``("engine", k)``: the rank dies at its engine's k-th I/O completion
  (``_native.testing().set_fault("kill")``: requests in flight, data files half written);
* ``("call", name, k)``: the coordinator dies just before the k-th call of
  ``os.<name>`` made through the file layer ``fp_dcp.files`` — the
  directories and the lock file opened (``open``, every one before the
  commit), ``open`` of the temporary metadata (the last ``open``), ``write``
  / ``fsync`` (#0) of the temporary metadata, ``fsync`` (#1) of the
  directory, ``replace`` (the commit), ``fsync`` (#2) of the directory
  again, ``unlink`` of superseded files;
* ``("after", 0)``: the rank dies right after ``dcp.save`` returned;
* ``("delay", seconds)``: the parent kills every rank after that delay;
* ``("pause", name, k, seconds)``: no kill; the coordinator sleeps before
  that call (holding the lock: concurrency tests).

``outcome(path, candidates)`` loads what the directory holds and says which
candidate state dict it is, bit for bit (``"absent"`` when nothing is
committed and the reader says so clearly); anything else — a mixed
checkpoint, wrong bytes, an unclear error — is an ``AssertionError``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from typing import Any

import numpy as np

WATCHED = ("open", "write", "fsync", "replace", "unlink")

# The commit point: kills before the k-th call below leave the old checkpoint.
COMMIT = ("replace", 0)


def state_dict(seed: int) -> dict[str, Any]:
    """Same structure for every seed, different bytes: large aligned tensors
    (zero-copy), odd sizes (bounce buffers), small packed ones, a bytes item."""
    import torch

    rng = np.random.default_rng(seed)

    def t(shape, dtype=np.float32):
        return torch.from_numpy(rng.standard_normal(shape).astype(dtype))

    return {
        "model": {"w1": t((512, 1024)), "w2": t((333, 1001)), "b": t((1001,)), "e": t((2048, 256), np.float16)},
        "optim": {"m": t((512, 1024)), "step": int(seed)},
        "small": [t((7,)), t((3, 3))],
    }


def zeros_like(sd: Any) -> Any:
    import torch

    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    return 0


def same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                                b.view(torch.uint8) if b.dtype != torch.uint8 else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class _OsProxy:
    """``fp_dcp.files.os`` in a child: counts the watched calls and dies
    before the chosen one."""

    def __init__(self, real, kill_at: tuple[str, int] | None, pause_at: tuple | None = None) -> None:
        self._real = real
        self._kill_at = kill_at
        self._pause_at = pause_at
        self.counts = {n: 0 for n in WATCHED}

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if name not in WATCHED:
            return value

        def call(*args, **kwargs):
            k = self.counts[name]
            self.counts[name] = k + 1
            if self._kill_at == (name, k):
                os.kill(os.getpid(), signal.SIGKILL)
            if self._pause_at is not None and self._pause_at[:2] == (name, k):
                time.sleep(self._pause_at[2])
            return value(*args, **kwargs)

        return call


def _child(path: str, seed: int, point: tuple | None, kill_rank: int, world: int, rank: int,
           init_file: str, options: dict, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fp_dcp.files as files_mod
    from fp_dcp import FastPersistWriter, _native

    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=20))
        sd = state_dict(seed)
        mine = point is not None and rank == kill_rank
        proxy = _OsProxy(os, tuple(point[1:]) if mine and point[0] == "call" else None,
                         tuple(point[1:]) if mine and point[0] == "pause" else None)
        files_mod.os = proxy
        if mine and point[0] == "engine":
            _native.testing().set_fault("kill", signal.SIGKILL, after=int(point[1]))  # FP_DCP_TEST_HOOKS=1 inherited
        w = FastPersistWriter(path, **options)
        dcp.save(sd, storage_writer=w)
        if mine and point[0] == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        stats = {"requests": int(w.last_stats.get("requests", 0)), "calls": dict(proxy.counts)}
        w.close()
        if world > 1:
            dist.destroy_process_group()
        queue.put((rank, True, stats))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, f"{type(e).__name__}: {e}"))


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "fp_dcp", "tests._crash"])
    return _CTX


def run_save(path: str, seed: int, point: tuple | None = None, *, world: int = 1, kill_rank: int = 0,
             options: dict | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """Save ``state_dict(seed)`` to ``path`` on ``world`` child ranks, killing
    as ``point`` says. Returns {"codes": exit codes, "results": {rank: stats or
    error text}, "killed": whether any rank died by SIGKILL}."""
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_child, args=(path, seed, point, kill_rank, world, r, init_file,
                                                  options or {}, queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        if point is not None and point[0] == "delay":
            time.sleep(float(point[1]))
            for p in procs:
                if p.is_alive():
                    p.kill()
        results: dict[int, Any] = {}
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        # a rank whose peer died may wait in a collective: give it a moment, then kill it
        for p in procs:
            if p.is_alive():
                p.join(5 if any(q.exitcode == -signal.SIGKILL for q in procs) else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        while not queue.empty():
            rank, ok, value = queue.get_nowait()
            results[rank] = value if ok else ("error", value)
    codes = [p.exitcode for p in procs]
    return {"codes": codes, "results": results, "killed": any(c == -signal.SIGKILL for c in codes)}


def count_points(path: str, seed: int, *, world: int = 1, options: dict | None = None) -> dict[str, Any]:
    """A save over an existing checkpoint, with no kill: each rank's engine
    requests and the coordinator's watched calls (removals of the files it
    supersedes included), to enumerate the points of the timeline."""
    first = run_save(path, seed, None, world=world, options=options)
    if any(c != 0 for c in first["codes"]):
        raise AssertionError(f"first save failed: {first}")
    r = run_save(path, seed, None, world=world, options=options)
    if any(c != 0 for c in r["codes"]) or len(r["results"]) != world:
        raise AssertionError(f"counting save failed: {r}")
    return {"requests": [r["results"][k]["requests"] for k in range(world)],
            "calls": r["results"][0]["calls"]}


def points(counts: dict[str, Any], *, kill_rank: int = 0, engine_points: int | None = None,
           overwrite: bool = True) -> list[tuple]:
    """Every point of a save's timeline (engine completions sampled down to
    ``engine_points`` evenly spaced ones when given). A save into a fresh
    directory (``overwrite=False``) removes no superseded file: no unlink points."""
    out: list[tuple] = []
    # The completions every save reaches: the counted save's last one is left
    # out, because the count can move by one between saves of the same structure
    # (CI once counted 27 and the killed save made 26, so the kill at #26
    # never fired); the one before it still kills with every request but one
    # written.
    n = max(1, counts["requests"][kill_rank] - 1)
    ks = list(range(n))
    if engine_points is not None and n > engine_points:
        ks = sorted({round(i * (n - 1) / max(1, engine_points - 1)) for i in range(engine_points)})
    out += [("engine", k) for k in ks]
    if kill_rank == 0:
        for name in WATCHED:
            if name == "unlink" and not overwrite:
                continue
            out += [("call", name, k) for k in range(counts["calls"][name])]
    out.append(("after", 0))
    return out


def committed(point: tuple) -> bool | None:
    """Whether a kill at ``point`` comes after the commit (None: cannot say)."""
    kind = point[0]
    if kind == "engine":
        return False
    if kind == "after":
        return True
    if kind == "call":
        # the order of the commit protocol (see the module docstring)
        name, k = point[1], point[2]
        if name == "replace":
            return k > 0
        if name == "open":
            return False  # the directories, the lock, the temporary metadata: all opened before the commit
        if name == "write":
            return False
        if name == "fsync":
            return k >= 2
        if name == "unlink":
            return True
    return None


def outcome(path: str, candidates: dict[str, int]) -> str:
    """Load ``path`` and name the candidate (name -> seed) it holds bit for
    bit, or "absent" when the reader refuses it as never committed."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    from torch.distributed.checkpoint.api import CheckpointException

    target = zeros_like(state_dict(0))
    reader = FastPersistReader(path)
    try:
        dcp.load(target, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        text = str(e)
        if "no committed fp_dcp checkpoint" in text or "no checkpoint directory here" in text:
            return "absent"
        raise AssertionError(f"{path}: load failed without a clear reason: {type(e).__name__}: {text[-2000:]}")
    finally:
        reader.close()
    for name, seed in candidates.items():
        if same(target, state_dict(seed)):
            return name
    raise AssertionError(f"{path}: loaded a checkpoint that is none of {sorted(candidates)}: mixed or wrong bytes")


def leftovers(path: str) -> list[str]:
    """Files in a checkpoint directory beyond the committed ones: stale
    temporary metadata and data files no committed metadata names."""
    from fp_dcp.load.reader import read_checkpoint_metadata

    _, layout, _ = read_checkpoint_metadata(path)
    keep = {name for name, _ in layout.files}
    return sorted(n for n in os.listdir(path)
                  if n not in keep and n not in (".fp_dcp.meta", ".fp_dcp.lock"))


def resources() -> dict:
    """What a fault must not leak: open descriptors, Python and native
    threads, AIO rings mapped in this process, and the engine's counters."""
    import gc
    import threading

    from fp_dcp import _native

    gc.collect()
    with open("/proc/self/maps") as f:
        aio = sum(1 for line in f if "[aio]" in line)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "aio_rings": aio,
        **_native.stats(),
    }


def leaks(before: dict, after: dict) -> dict:
    """The resources of ``after`` above their count in ``before``: a leak.
    Fewer than before is not one (a pool or ring left by an earlier test may
    end while this one runs)."""
    return {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}


def settle(before: dict, timeout: float = 60.0) -> dict:
    """The leaks (:func:`leaks`) once there are none (threads of a finished
    pool exit when the scheduler gets to them), or as they are after
    ``timeout`` seconds: a bound on a leak that never goes away, not a window
    a correct run must fit in (it returns as soon as nothing is above
    ``before``).  Empty: nothing leaked."""
    deadline = time.monotonic() + timeout
    left = leaks(before, resources())
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leaks(before, resources())
    return left
