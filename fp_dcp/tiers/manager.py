"""``TierManager``: multi-tier checkpointing of a series of training steps
(docs/TIERS.md)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from fp_dcp import FastPersistOptions, FastPersistWriter, wire
from fp_dcp import files as _files
from fp_dcp import format as fmt
from fp_dcp.tiers import drain, integrity, store
from fp_dcp.tiers import restore as _restore
from fp_dcp.tiers.agree import exchange, share
from fp_dcp.tiers.replicate import FileIO, Transfer, file_io_for, run_transfers
from fp_dcp.tiers.topology import Topology, ranks_per_node_from_env

__all__ = ["TierManager"]

log = logging.getLogger("fp_dcp.tiers")

#: how many earlier steps' replications may still be queued or running when
#: :meth:`TierManager.save` returns (it waits for the older ones); the saver
#: thread meanwhile runs the newest step's local save
BEHIND = 1


class TierManager:
    """Checkpoint a training job into tiers: node-local every save, replicated to
    other nodes, drained to ``persistent_root`` (``None``: no drains) every
    ``persist_every`` steps.  A collective: every rank constructs it.

    ``local_root``: each node's directory (``{node}`` becomes the node number).
    ``replicas``: copies of each node's files on other nodes (fewer, with a
    warning, when there are fewer nodes).  ``keep_local`` / ``keep_persistent``:
    retention in committed steps.  Nodes: ``topology``, else ``ranks_per_node``,
    else ``FP_DCP_RANKS_PER_NODE`` or ``LOCAL_WORLD_SIZE``, else one per host.
    ``options``: of the local saves and restores (default: environment, lazy
    staging).  ``drain_retries`` (``drain_retry_seconds`` apart): a drain that
    still fails is reported in :attr:`errors`.  ``timeout``: of the manager's
    process groups.  ``background_nice``: nice value of the manager's threads
    (0: unchanged).  Parameters in full: docs/TIERS.md."""

    def __init__(
        self,
        local_root: str | os.PathLike,
        persistent_root: str | os.PathLike | None = None,
        *,
        replicas: int = 1,
        persist_every: int = 10,
        keep_local: int = 2,
        keep_persistent: int = 2,
        ranks_per_node: int | None = None,
        topology: Topology | None = None,
        options: FastPersistOptions | None = None,
        transport: str = "gloo",
        drain_retries: int = 2,
        drain_retry_seconds: float = 1.0,
        timeout: timedelta = timedelta(minutes=30),
        background_nice: int = 10,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TierManager needs torch.distributed initialized (init_process_group) first")
        if transport not in ("gloo", "nccl"):
            raise ValueError(f"transport must be 'gloo' or 'nccl', got {transport!r}")
        if persist_every < 1 or keep_local < 1 or keep_persistent < 1:
            raise ValueError("persist_every, keep_local and keep_persistent must be at least 1")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            k = ranks_per_node or ranks_per_node_from_env()
            if k is not None:
                topology = Topology.by_ranks_per_node(self.world_size, k)
            else:
                hosts = wire.gather(socket.gethostname(), str, what="tiers: host names")
                topology = Topology.by_host(hosts)
        if topology.world_size != self.world_size:
            raise ValueError(f"the topology places {topology.world_size} ranks; the job has {self.world_size}")
        self.topology = topology
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        # a job restarted on fewer nodes keeps as many replicas as it can
        self.replicas = min(replicas, len(topology.nodes) - 1)
        if self.replicas < replicas and self.rank == 0:
            warnings.warn(f"fp_dcp tiers: {replicas} replica(s) asked, but {len(topology.nodes)} node(s): "
                          f"keeping {self.replicas}", RuntimeWarning, stacklevel=2)
        self.node = topology.node_of(self.rank)
        self.local_root = store.node_root(os.fspath(local_root), self.node)
        self.persistent_root = None if persistent_root is None else os.fspath(persistent_root)
        self.persist_every = persist_every
        self.keep_local = keep_local
        self.keep_persistent = keep_persistent
        self.drain_retries = drain_retries
        self.drain_retry_seconds = drain_retry_seconds
        base = options if options is not None else FastPersistOptions.from_env(staging="lazy")
        if base.data_dirs:
            raise ValueError("TierManager: each node's local root is its data directory; leave data_dirs empty")
        self.options = base
        _files.Root(self.local_root, create=True).close()
        nice = functools.partial(_lower_priority, background_nice)
        # One gloo group per background thread (and one for the NCCL
        # transport).  They are made on a thread at the background's nice
        # value: gloo's threads (the one that moves a group's bytes, the
        # ones that run its collectives) start there and inherit it, so the
        # replication's traffic yields the CPU to the training too.
        with concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-tiers-setup", initializer=nice) as setup:
            self._save_group, self._repl_group, self._drain_group = setup.submit(
                lambda: [dist.new_group(backend="gloo", timeout=timeout) for _ in range(3)]).result()
        self._bytes_group = self._repl_group if transport == "gloo" else dist.new_group(backend="nccl", timeout=timeout)
        self._timeout = timeout
        self.writer = FastPersistWriter(options=self.options)
        self._files: FileIO | None = None  # the replicator thread's O_DIRECT reads and writes of replicas
        self._drain_io = drain.DrainIO(self.options)  # the drain thread's
        # Two stages, one thread each, so that a step's replication overlaps
        # the next step's local save: the saver runs dcp.save (the staging
        # arena is busy until it returns), the replicator everything after it.
        self._saver = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-tiers", initializer=nice)
        self._replicator = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-tiers-replicate", initializer=nice)
        self._drainer = concurrent.futures.ThreadPoolExecutor(1, "fp_dcp-drain", initializer=nice)
        self._staged: concurrent.futures.Future | None = None
        self._jobs: list[concurrent.futures.Future] = []
        self._drains: list[concurrent.futures.Future] = []
        self._pinned: set[int] = set()  # local steps a queued drain still reads
        self._lock = threading.Lock()
        #: what went wrong in the background (replication, drains), oldest first
        self.errors: list[str] = []
        #: per step: what the background work did on this rank
        self.history: dict[int, dict[str, Any]] = {}
        self.last_restore: _restore.RestoreResult | None = None
        self._closed = False

    # ------------------------------------------------------------ the loop

    def save(self, step: int, state_dict: dict[str, Any]) -> concurrent.futures.Future:
        """Checkpoint ``state_dict`` as ``step`` (every rank, same steps); returns at
        once with a future of the local save and replication.  With lazy staging
        call :meth:`wait_staged` before the state changes.  An earlier step's
        failure is raised here."""
        if self._closed:
            raise RuntimeError("TierManager is closed")
        self._reap(keep=BEHIND)
        store.claim_step(self.local_root, step)  # a link or a folder the tiers did not make there: refused
        # What dcp.async_save does, with the save on the manager's own
        # (low-priority) thread: the writer stages (lazy: a future), then
        # dcp.save writes the staged copy; the replicator takes it from there.
        staged = self.writer.stage(state_dict)
        self._staged = staged if isinstance(staged, concurrent.futures.Future) else None
        saved = self._saver.submit(self._save_local, step, staged)
        job = self._replicator.submit(self._after_save, step, saved)
        self._jobs.append(job)
        return job

    def wait_staged(self) -> None:
        """Wait until the last :meth:`save` has its copy of the state (lazy
        staging); then the state may change."""
        if self._staged is not None:
            self._staged.result()
            self._staged = None

    def wait(self) -> None:
        """Wait for every save, replication and drain queued so far; raises
        the first failure of a save or replication."""
        self.wait_staged()
        self._reap(keep=0)
        with self._lock:
            queued = list(self._drains)
        for d in queued:
            d.result()

    def restore(self, state_dict: dict[str, Any], *, step: int | None = None, planner: Any = None) -> int | None:
        """Load the newest step complete in any tier (or ``step``) into
        ``state_dict`` in place; returns the step, or ``None`` when no tier
        holds one.  Every rank calls it, with no save in flight.  Details
        of what came from where: :attr:`last_restore`."""
        self.wait()
        result = _restore.restore(
            state_dict, rank=self.rank, topology=self.topology, local_root=self.local_root,
            persistent_root=self.persistent_root, group=self._repl_group, bytes_group=self._bytes_group,
            planner=planner, step=step, options=self.options, timeout=self._timeout,
        )
        self.last_restore = result
        if result is not None and result.skipped and self.rank == 0:
            warnings.warn(f"fp_dcp tiers: restore of step {result.step} skipped bad copies: "
                          + "; ".join(result.skipped), RuntimeWarning, stacklevel=2)
        return None if result is None else result.step

    def close(self) -> None:
        """Wait for all background work, then release the writer and the threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._saver.shutdown(wait=True)
            self._replicator.shutdown(wait=True)
            self._drainer.shutdown(wait=True)
            self.writer.close()
            if self._files is not None:
                self._files.close()
                self._files = None
            self._drain_io.close()

    def __enter__(self) -> "TierManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------- background

    def _reap(self, keep: int) -> None:
        while len(self._jobs) > keep:
            self._jobs.pop(0).result()

    def _save_local(self, step: int, staged: Any) -> dict[str, Any]:
        """The saver thread: the local save of ``step`` (``dcp.save`` of the
        staged copy).  Returns its wall seconds (``*_seconds``) and this
        thread's CPU seconds."""
        clock = _Clock()
        if isinstance(staged, concurrent.futures.Future):
            staged = staged.result()
        clock.lap("staged")
        # Plan caching: every step has the state dict's structure of the one
        # before, so DCP and the writer reuse their plans instead of making
        # and exchanging them again (Python on this thread, holding the GIL
        # the training needs).
        dcp.save(staged, storage_writer=self.writer, checkpoint_id=store.step_dir(self.local_root, step),
                 process_group=self._save_group, planner=DefaultSavePlanner(enable_plan_caching=True))
        del staged
        clock.lap("save")
        return {**clock.laps, **clock.cpu_laps, "save_cpu": clock.cpu()}

    def _after_save(self, step: int, saved: concurrent.futures.Future) -> dict[str, Any]:
        """The replicator thread, once ``step`` is saved: metadata to every node,
        replicas, retention, drain; records each phase's seconds in :attr:`history`."""
        local = saved.result()  # the save's failure is this step's
        clock = _Clock()
        directory = store.step_dir(self.local_root, step)
        # rank 0 (DCP's coordinator) has the committed metadata; a failure to
        # read it reaches every rank now, not as a 30-minute wait (agree)
        blob = share(self._repl_group, 0, f"tiers: step {step}: reading the metadata",
                     lambda: store.read_metadata(directory))
        _, layout, _ = store.decode(blob, os.path.join(directory, fmt.METADATA_NAME))
        clock.lap("metadata")
        stats = self._replicate(step, directory, layout, clock)
        leader = self.topology.leader(self.node) == self.rank

        def name_metadata() -> None:
            if leader and self.node != self.topology.node_of(0):
                store.write_atomic(os.path.join(directory, fmt.METADATA_NAME), blob, sync=self.options.sync_files)

        exchange(self._repl_group, self.world_size, f"tiers: step {step}: writing the metadata on every node",
                 name_metadata)  # also the barrier: every node's copy is named before retention
        clock.lap("barrier")
        drain_now = self.persistent_root is not None and step % self.persist_every == 0
        if drain_now:
            with self._lock:
                self._pinned.add(step)
        cpu = local.pop("save_cpu") + clock.cpu()
        info = {**local, **clock.laps, **clock.cpu_laps, **stats, "cpu_seconds": cpu}
        self.history[step] = info  # before the drain adds its outcome to it
        # The drain thread does the housekeeping too: removing a step's files
        # takes the file system a while, which the replicator's next step
        # need not wait for.
        if drain_now:
            self._housekeep(self._drain, step)
        if leader:
            self._housekeep(self._retain, step)
        return info

    def _housekeep(self, work: Any, step: int) -> None:
        """Queue ``work(step)`` on the drain thread (:meth:`wait` waits for it)."""
        with self._lock:
            self._drains = [d for d in self._drains if not d.done()]
            self._drains.append(self._drainer.submit(work, step))

    def _retain(self, step: int) -> None:
        """Local retention once ``step`` is replicated: later steps do not count yet,
        and steps a queued drain reads stay."""
        t0 = time.perf_counter()
        with self._lock:
            pinned = set(self._pinned)
        try:
            store.retain(self.local_root, self.keep_local, pinned, newest=step)
        except OSError as e:  # the next step's retention tries again
            self._report(f"step {step}: local retention failed: {e}")
        self.history[step]["retain_seconds"] = time.perf_counter() - t0

    def _replicate(self, step: int, directory: str, layout: fmt.StorageLayout, clock: "_Clock") -> dict[str, Any]:
        """Send this rank's files of the step to its partners and take in theirs,
        each received file checked and renamed into place only then."""
        fid_of = {n: i for i, (n, _) in enumerate(layout.files)}
        transfers = [
            Transfer(src, dst, *layout.files[fid])  # (name, size)
            for src, dst in self.topology.replication_pairs(self.replicas)
            for fid in drain.files_of_rank(layout, src)
        ]
        files = self._files = file_io_for(self._files, self.options, directory)
        sync = self.options.sync_files
        phase = {"read": 0.0, "check": 0.0, "write": 0.0}

        def read(t: Transfer):
            t0 = time.perf_counter()
            try:
                return files.read(os.path.join(directory, t.name), t.size)
            finally:
                phase["read"] += time.perf_counter() - t0

        def receive(t: Transfer, data) -> None:
            t0 = time.perf_counter()
            integrity.check_buffer(data, layout, fid_of[t.name], f"{t.name} from rank {t.src}")
            t1 = time.perf_counter()
            try:
                files.write_named(os.path.join(directory, t.name), data, sync)  # named only when checked
            finally:
                phase["check"] += t1 - t0
                phase["write"] += time.perf_counter() - t1

        stats, failed = run_transfers(transfers, self.rank, self._bytes_group, read, receive,
                                      receive_buffer=lambda t: files.buffer(t.size))
        if stats["received_bytes"] and sync:
            with store.opened(directory) as d:
                d.sync()  # the replicas' names
        for t, why in failed.items():
            self._report(f"step {step}: replica of {t.name} (rank {t.src} -> rank {t.dst}) failed: {why}")
        clock.lap("replicate")
        return {**stats, **{f"replica_{k}_seconds": v for k, v in phase.items()}}

    def _drain(self, step: int) -> drain.DrainResult:
        assert self.persistent_root is not None  # drains run only with a persistent root
        try:
            for attempt in range(self.drain_retries + 1):
                result = drain.drain_step(step, store.step_dir(self.local_root, step), self.persistent_root,
                                          self.rank, self._drain_group, keep=self.keep_persistent,
                                          sync=self.options.sync_files, io=self._drain_io)
                if result.ok:
                    break
                self._report(f"step {step}: drain attempt {attempt + 1} failed: {result.error}")
                if attempt < self.drain_retries:
                    time.sleep(self.drain_retry_seconds)
            self.history.setdefault(step, {})["drain"] = result
            return result
        finally:
            with self._lock:
                self._pinned.discard(step)

    def _report(self, message: str) -> None:
        self.errors.append(message)
        log.warning("fp_dcp tiers: %s", message)
        if self.rank == 0:
            warnings.warn(f"fp_dcp tiers: {message}", RuntimeWarning, stacklevel=3)


class _Clock:
    """Wall seconds of consecutive phases of the calling thread
    (``laps["<phase>_seconds"]``), its CPU seconds in each
    (``cpu_laps["<phase>_cpu_seconds"]``) and since it was made."""

    def __init__(self) -> None:
        self._cpu0 = self._cpu_last = time.thread_time()
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.cpu_laps: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.laps[f"{phase}_seconds"] = now - self._last
        self.cpu_laps[f"{phase}_cpu_seconds"] = cpu - self._cpu_last
        self._last, self._cpu_last = now, cpu

    def cpu(self) -> float:
        return time.thread_time() - self._cpu0


def _lower_priority(nice: int) -> None:
    """Give the calling thread (Linux: a thread id is a process id for
    setpriority) the nice value ``nice``, if the system allows it."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass
