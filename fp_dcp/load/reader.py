"""``FastPersistReader``: the DCP ``StorageReader`` protocol only; the work is in
:mod:`~fp_dcp.load.jobs`, :mod:`~fp_dcp.load.execute` and
:mod:`~fp_dcp.load.sharing` (docs/ARCHITECTURE.md, "How a load reads")."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
import warnings
from typing import Any, Callable, Iterator, cast

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fp_dcp import _stateful
from fp_dcp import format as fmt
from fp_dcp._dcp_hooks import logged_metadata_errors
from fp_dcp.checksums import ReadVerifier
from fp_dcp.engine import EngineSet, IOSession
from fp_dcp.files import read_checkpoint_metadata
from fp_dcp.gc_freeze import GcFreeze, paused
from fp_dcp.load import objects
from fp_dcp.load.execute import Run
from fp_dcp.load.jobs import ItemPlanner, Job, Limits
from fp_dcp.load.sharing.plan import MachineInfo, SharePlan, plan_sharing
from fp_dcp.load.sharing.rounds import SharedReads
from fp_dcp.load.sharing.transport import machine_id, transfer_device
from fp_dcp.options import FastPersistOptions

__all__ = ["FastPersistReader", "read_checkpoint_metadata"]

# The reader's engine when FastPersistOptions leave queue_depth and
# block_size_bytes to the engine (see FastPersistReader._engine): the reader
# only reads, and small runs (a column shard is one run per row) need many
# requests in flight, while long runs go in place, through the arena, or to
# the engine of large requests anyway.  Same bounce memory as the engine's
# defaults (qd+1 slots of one block).
_READ_QUEUE_DEPTH = 64
_READ_BLOCK_BYTES = 256 << 10
# The read items are planned in chunks while the chunk before is read
# (Run.stream): the first chunk small, so the disk starts early, then each
# twice the one before (fewer engine calls, each of which starts with an
# empty queue and ends draining it), up to this many bytes.
_PLAN_CHUNK_FIRST_BYTES = 8 << 20
_PLAN_CHUNK_MAX_BYTES = 256 << 20


class FastPersistReader(StorageReader):
    """Load a checkpoint written by :class:`~fp_dcp.FastPersistWriter` from
    ``path``, into any world size and sharding.

    ``options`` / keyword arguments as for the writer.  ``process_group``: the
    group passed to ``dcp.load`` when not the default (used only by the
    ``share_*`` options).  After each load :attr:`last_stats` holds this rank's
    ``bytes``, ``bytes_read``, ``requests``, ``pieces``, ``seconds``, the engine
    and, with sharing, ``shared_bytes_read`` / ``_sent`` / ``_received`` /
    ``_pulled``, ``shared_rounds`` and ``shared_buffer_bytes``.  Engines and
    their page-locked buffers are kept until :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        options: FastPersistOptions | None = None,
        *,
        process_group: Any = None,
        **option_kwargs: Any,
    ) -> None:
        super().__init__()
        _stateful.install()  # DCP's copy of the state dict without per-key records, its Stateful check quick
        base = options if options is not None else FastPersistOptions.from_env()
        self.options = base.replace(**option_kwargs) if option_kwargs else base
        self.path = None if path is None else os.fspath(path)
        self.process_group = process_group
        self.load_id = secrets.token_hex(8)
        self.layout: fmt.StorageLayout | None = None
        self.state_dict_metadata: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self.progress: Callable[[int, int], None] | None = None  # (bytes done, bytes total), for tools
        self._engines = EngineSet()
        self._items: ItemPlanner | None = None  # the checkpoint's items to jobs, from set_up_storage_reader
        self._verifier: ReadVerifier | None = None
        self._use_collectives = True
        self._gc = GcFreeze()

    # ----------------------------------------------------------- DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = secrets.token_hex(8)
        self.layout = None
        self._items = None
        self._verifier = None
        self._gc.thaw()  # a load that failed part-way left it frozen

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        return os.path.exists(os.path.join(os.fspath(checkpoint_id), fmt.METADATA_NAME))

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @logged_metadata_errors
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.options.freeze_gc_during_load:
            with paused():  # tens of thousands of objects, none garbage
                metadata, _, _ = read_checkpoint_metadata(self._directory())
        else:
            metadata, _, _ = read_checkpoint_metadata(self._directory())
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, fmt.StorageLayout):
            raise fmt.CheckpointFormatError(
                f"{self.path}: the metadata passed to FastPersistReader does not come from an fp_dcp checkpoint"
            )
        self.layout = metadata.storage_data
        self.state_dict_metadata = metadata.state_dict_metadata
        self._use_collectives = bool(kwargs.get("use_collectives", True))
        self._items = ItemPlanner(self.layout, self.state_dict_metadata, str(self.path),
                                  strict_dtype=self.options.strict_dtype, allow_pickle=self.options.allow_pickle)
        self._verifier = None
        if not self._may_share():
            # no plan can share reads: the engines' set-up (bounce buffers
            # faulted in and locked, without the GIL) need not wait for
            # prepare_local_plan; it overlaps the planner's create_local_plan
            self._set_up_engines_early(False)
        if self.options.freeze_gc_during_load:
            self._gc.freeze()  # until the end of read_data (gc_freeze)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        with self._gc.thaw_on_error():
            return self._prepare_local_plan(plan)

    def _prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        opts = self.options
        interleave = self._interleave_wanted()  # auto: when this rank has pieces to share
        fragmented = [self._fragmented(r) for r in plan.items] if interleave else []
        may_share = self._use_collectives and (opts.share_replicated_reads or (interleave and (
            opts.share_interleaved_reads or any(fragmented))))
        # shared reads go into aligned temporaries and never touch the engine's
        # bounce buffers: fault them in early only for a plan with other reads
        self._set_up_engines_early(may_share, bounce=not (may_share and fragmented and all(fragmented)))
        if interleave and opts.share_interleaved_reads is None:
            # auto shares rows only among ranks of one machine: the coordinator
            # learns each rank's machine from its plan
            plan = dataclasses.replace(plan, storage_data=MachineInfo(machine_id()))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        with self._gc.thaw_on_error():
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not (self.options.share_replicated_reads or self._interleave_wanted()) or len(plans) < 2:
            return plans
        share = self._plan_sharing(plans)
        if share is None:
            return plans
        return [dataclasses.replace(p, storage_data=share) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        self.last_stats = {}
        try:
            share = self._agreed_share_plan(plan)
            self._read(plan.items, planner, share)
        finally:
            self._gc.thaw()
        self.last_stats["seconds"] = time.perf_counter() - t0
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        self._engines.close()
        self._gc.thaw()

    def __enter__(self) -> "FastPersistReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------- helpers

    def _directory(self) -> str:
        if self.path is None:
            raise ValueError(
                "FastPersistReader has no path: pass FastPersistReader(path) or dcp.load(..., checkpoint_id=path)"
            )
        return self.path

    def _interleave_wanted(self) -> bool:
        """``share_interleaved_reads``, its ``None`` (auto) resolved: on when
        the load's process group moves tensors on the CPU."""
        wanted = self.options.share_interleaved_reads
        if wanted is not None:
            return wanted
        import torch.distributed as dist

        if not (self._use_collectives and dist.is_available() and dist.is_initialized()):
            return False
        return transfer_device(self.process_group).type == "cpu"

    def _may_share(self) -> bool:
        """Whether some plan could share reads (False when no option asks and no
        process group moves tensors on the CPU)."""
        opts = self.options
        return self._use_collectives and (opts.share_replicated_reads or self._interleave_wanted())

    def _fragmented(self, req: ReadItem) -> bool:
        """Whether the item needs many runs of its stored chunk (a dimension
        after the first cut while an earlier one spans several indices): what
        interleaved reads are for."""
        if req.type != LoadItemType.TENSOR:
            return False
        md = self.state_dict_metadata.get(req.storage_index.fqn)
        lengths = list(req.lengths)
        if not isinstance(md, TensorStorageMetadata) or lengths[1:] == list(md.size)[1:]:
            return False  # whole rows of the tensor: one run (the common case, checked without the chunk)
        assert self._items is not None
        try:
            sizes, _ = self._items.chunk_sizes(req.storage_index.fqn, list(req.storage_index.offset or ()))
        except fmt.CheckpointFormatError:
            return False  # the read reports it
        span = 1
        for d, (n, size) in enumerate(zip(lengths, sizes)):
            if d and n < size and span > 1:
                return True
            span *= n
        return False

    def _set_up_engines_early(self, twin: bool, bounce: bool = True) -> None:
        """Start setting the engines up on a thread of their own while DCP
        plans (``EngineSet.in_background``: the first call wins; best effort,
        ``read_data``'s own set-up raises what failed)."""
        if self.path is None:
            return

        engines: list[IOSession] = []

        def work() -> None:
            session = self._engine()
            large = self._large_engine()
            # the engines of long runs first: a load of large tensors reads
            # through them alone, from their first slot on
            if large is not None:
                engines.extend([large, *self._more_large_engines()])
            engines.append(session)
            if twin:
                self._twin(0)

        def settle() -> None:
            for s in engines:
                s.engine.settle_pool()

        self._engines.in_background(work, "fp_dcp-reader-setup", settle if bounce else None)

    def _twin(self, i: int) -> tuple[IOSession, IOSession | None]:
        """The ``i``-th other pair of sessions (scattered runs, long runs),
        for shared reads' reading threads: each thread its own engines."""
        self._engine()
        self._large_engine()
        return self._engines.twin(i)

    def _more_large_engines(self) -> list[IOSession]:
        """The other engines of large requests (``read_threads`` in all);
        none without an engine of large requests."""
        if self._large_engine() is None:
            return []
        return self._engines.more_large(max(0, self.options.read_threads - 1))

    def _large_engine(self) -> IOSession | None:
        """The engine of large requests for long runs; None when the options
        set the engine's shape (they override the rule) or when the rule
        gives no larger request."""
        opts = self.options
        if opts.queue_depth is not None or opts.block_size_bytes is not None:
            return None
        self._engine()
        return self._engines.large_session(_READ_BLOCK_BYTES)

    def _engine(self) -> IOSession:
        directory = self._directory()
        opts = self.options
        if opts.queue_depth is None and opts.block_size_bytes is None:
            opts = opts.replace(queue_depth=_READ_QUEUE_DEPTH, block_size_bytes=_READ_BLOCK_BYTES)
        return self._engines.session(opts, directory)

    def _checksums(self, paths: list[str]) -> ReadVerifier | None:
        """The stored checksums laid out for checking reads (built once per
        checkpoint), or None when the checkpoint has none or checks are off."""
        if not self.options.verify_checksums:
            return None
        if self._verifier is None or self._verifier.paths != paths:
            assert self.layout is not None
            self._verifier = ReadVerifier(self.layout, paths)
        return self._verifier if self._verifier.enabled else None

    # ----------------------------------------------------------- the load

    def _read(self, items: list[ReadItem], planner: LoadPlanner, share: SharePlan | None) -> None:
        t0 = time.perf_counter()
        run: Run | None = None
        setup_error: BaseException | None = None
        try:
            assert self._items is not None, "set_up_storage_reader comes first"
            objects.check_bytes_targets(items, planner, str(self.path))  # before any byte is read
            run = self._new_run()
        except BaseException as e:  # noqa: BLE001
            if share is None:
                raise
            setup_error = e  # the other ranks learn it in the first round's collective
        try:
            if share is not None:
                t1 = time.perf_counter()
                shared = SharedReads(self.process_group, share, run, self._twin, cast(ItemPlanner, self._items),
                                     planner, items, setup_error)
                items = shared.run()
                assert run is not None
                run.stats["share_seconds"] = time.perf_counter() - t1
                t0 += run.stats["share_seconds"]
            assert run is not None
            run.stats["plan_seconds"] = time.perf_counter() - t0
            run.stream(self._planned(items, planner, run))
        finally:
            if run is not None:
                run.close()
            self._engines.settled()  # nothing of this load's outlives it (pools an engine never needed)
        self.last_stats.update(run.stats)

    def _planned(self, items: list[ReadItem], planner: LoadPlanner, run: Run) -> Iterator[list[Job]]:
        """The jobs of ``items`` in chunks growing from small (the first read starts
        early) to ``_PLAN_CHUNK_MAX_BYTES``, objects first."""
        assert self._items is not None
        plan_item = self._items.plan_item
        limits = run.limits
        ordered = iter(sorted(items, key=lambda r: r.type != LoadItemType.BYTE_IO))  # stable: objects first
        goal = _PLAN_CHUNK_FIRST_BYTES

        def chunk() -> list[Job]:
            jobs: list[Job] = []
            nbytes = 0
            # a few objects per item and no cyclic garbage: no collections
            # walking them while the chunk is planned (the reads go on)
            with paused():
                for req in ordered:
                    new = plan_item(req, planner, limits)
                    jobs.extend(new)
                    nbytes += sum(j.needed for j in new)
                    if nbytes >= goal and req.type != LoadItemType.BYTE_IO:  # every object in the first chunk
                        break
            return jobs

        while True:
            t0 = time.perf_counter()
            jobs = chunk()
            run.stats["plan_seconds"] += time.perf_counter() - t0
            if not jobs:
                return
            yield jobs
            goal = min(2 * goal, _PLAN_CHUNK_MAX_BYTES)

    def _new_run(self) -> Run:
        """The executor of this load: the engines, the data files, the
        stored checksums and the limits the jobs are planned within."""
        self._engines.ready()  # the engines are made; their bounce pools may still be settling
        session = self._engine()
        assert self.layout is not None
        paths = fmt.data_file_paths(self._directory(), self.layout)
        opts = self.options
        alignment = session.alignment
        budget = opts.read_buffer_budget_bytes
        file_sizes = np.array([size for _, size in self.layout.files] or [0], dtype=np.int64)
        limits = Limits(alignment, max(alignment, budget // 4), file_sizes, opts.max_overread_percent / 100)
        verifier = self._checksums(paths)
        return Run(session, paths, limits, large=self._large_engine(), more=self._more_large_engines(),
                   budget=budget, coalesce_gap=opts.coalesce_gap_bytes, max_overread_percent=opts.max_overread_percent,
                   verifier=verifier, progress=self.progress)

    def _plan_sharing(self, plans: list[LoadPlan]) -> SharePlan | None:
        """On the coordinator: the load's shared reads
        (:func:`fp_dcp.load.sharing.plan.plan_sharing`), or None where the
        load's process group cannot carry them."""
        import torch.distributed as dist

        opts = self.options
        if not (self._use_collectives and dist.is_available() and dist.is_initialized()):
            return None
        interleave = self._interleave_wanted()
        if dist.get_world_size(self.process_group) != len(plans):
            if not (opts.share_replicated_reads or opts.share_interleaved_reads):
                return None  # auto: nothing was asked for, nothing to warn about
            which = "share_interleaved_reads" if opts.share_interleaved_reads else "share_replicated_reads"
            warnings.warn(
                f"{which}: dcp.load runs on {len(plans)} ranks but the reader's process group "
                f"has {dist.get_world_size(self.process_group)}; pass the group dcp.load uses as "
                f"FastPersistReader(process_group=...). Reading without sharing.",
                stacklevel=3,
            )
            return None
        assert self._items is not None
        if not opts.share_replicated_reads:
            # only reads of two or more dimensions can be interleaved: the
            # rest make no shared unit, and are not looked at (nor decoded)
            plans = [dataclasses.replace(p, items=_interleavable(p.items)) for p in plans]
        return plan_sharing(plans, self.state_dict_metadata, self._items.chunk_sizes,
                            budget=opts.read_buffer_budget_bytes, interleave=interleave,
                            interleave_auto=opts.share_interleaved_reads is None,
                            replicate=opts.share_replicated_reads, transport=opts.shared_read_transport)

    def _agreed_share_plan(self, plan: LoadPlan) -> SharePlan | None:
        """The sharing plan the coordinator put in this rank's plan: the same on every
        rank, so every rank runs the same collectives."""
        share = plan.storage_data if isinstance(plan.storage_data, SharePlan) else None
        if share is None or not self._use_collectives:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return share


def _interleavable(items: list) -> list:
    """The tensor reads of two or more dimensions among ``items`` (a plan
    whose items still travel as columns, fp_dcp's planners', decodes only
    those)."""
    pick = getattr(items, "tensor_reads", None)
    if callable(pick):
        return pick(2)
    return [r for r in items if r.type == LoadItemType.TENSOR and len(r.lengths) >= 2]
