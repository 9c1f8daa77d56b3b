"""``FastPersistWriter``: the DCP ``StorageWriter`` protocol only, each method
handing one of DCP's calls to the save path's modules (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import fp_dcp
from fp_dcp import _dcp_hooks, _stateful
from fp_dcp import format as fmt
from fp_dcp.engine import EngineSet, IOSession
from fp_dcp.files import Root
from fp_dcp.gc_freeze import GcFreeze, paused
from fp_dcp.options import FastPersistOptions
from fp_dcp.save import commit, directories, execute
from fp_dcp.save import recycle as recycling
from fp_dcp.save.plan import (
    Assignment,
    GlobalRecord,
    RankHoldings,
    assign,
    assignment_items,
    describe_rank,
    expected_nbytes,
    keep_global_record,
)
from fp_dcp.save.results import RankResults, check_layout_covers, layout_from_results
from fp_dcp.staging import AsyncStagingMixin

__all__ = ["FastPersistWriter"]

# the DCP version FileSystemWriter records in the metadata it writes
_DCP_VERSION = getattr(torch.distributed.checkpoint.filesystem, "CURRENT_DCP_VERSION", None)


class FastPersistWriter(AsyncStagingMixin, StorageWriter):
    """Write a DCP checkpoint into the directory ``path``.

    ``options``: a :class:`~fp_dcp.FastPersistOptions`; keyword arguments are
    shorthand for its fields.  One writer serves a series of saves (the engine
    and its buffers are kept); :meth:`close` (or ``with``) releases them.
    After each save :attr:`last_stats` holds this rank's engine, bytes, seconds,
    throughput and ``sync_seconds`` / ``sync_wait_seconds``; on the coordinator
    also ``prepare_commit_seconds``, and :attr:`last_plan` describes the placement.

    ``recycle``: a committed fp_dcp checkpoint directory that the next save
    replaces (the one rotation would delete after it).  That save retires it
    as it begins (it is no longer a checkpoint from then on, whatever
    happens) and writes over its data files' blocks instead of allocating
    new ones; what it does not reuse is removed once the save ends.  The
    coordinator's ``recycle`` is the one used, for one save (then None).  A
    checkpoint being saved into, a link, or a directory that is no committed
    fp_dcp checkpoint is left as it is, with a warning (docs/OPTIONS.md,
    "Recycling a retired checkpoint")."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        options: FastPersistOptions | None = None,
        *,
        recycle: str | os.PathLike | None = None,
        **option_kwargs: Any,
    ) -> None:
        super().__init__()
        _stateful.install()  # DCP's copy of the state dict without per-key records, its Stateful check quick
        base = options if options is not None else FastPersistOptions.from_env()
        self.options = base.replace(**option_kwargs) if option_kwargs else base
        self.path = None if path is None else os.fspath(path)
        self.recycle = None if recycle is None else os.fspath(recycle)
        if self.recycle is not None and self.path is not None:
            recycling.check_recycle_path(self.recycle, self.path)
        self.data_dirs = directories.parse_data_dirs(self.options.data_dirs)
        a = self.options.split_alignment_bytes
        if a <= 0 or a & (a - 1):
            raise ValueError(f"FastPersistOptions.split_alignment_bytes must be a power of two, got {a}")
        self.last_plan: dict[str, Any] = {}
        self.save_id = self._new_save_id()
        self._save_token: str | None = None  # this save's local items' token (None: DCP sent a cached plan)
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: dict[str, Any] = {}
        self._engines = EngineSet()
        self._lock = commit.SaveLock()
        self._gc = GcFreeze()
        self._pending_record: GlobalRecord | None = None  # the coordinator's, kept by write_data if the planner caches
        self._world_size = 0  # the coordinator's, from prepare_global_plan
        self._prepared: _PreparedCommit | None = None  # the coordinator's, made by write_data for finish
        self._retired: recycling.Retired | None = None  # the coordinator's, from prepare_global_plan to the save's end

    @staticmethod
    def _new_save_id() -> str:
        return time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(4)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._lock.release()
        self._end_retired()  # a save that failed part-way
        self._gc.thaw()  # ... left it frozen
        self._engines.settled()  # ... or its engines' early settle unwaited for
        self.save_id = self._new_save_id()
        self.last_stats = {}
        self._prepared = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = 0 if rank is None else int(rank)
        if self.options.freeze_gc_during_save:
            self._gc.freeze()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with self._gc.thaw_on_error():
            return self._prepare_local_plan(plan)

    def _prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        directories.make_checkpoint_directory(self._directory(), self.options.overwrite)
        granularity = self.options.split_alignment_bytes
        dirs = self._data_directories()
        sessions = []
        for d, by_path in dirs:
            directories.make_data_directory(d, by_path, self.options.sync_files)
            # fail before any rank writes if the engine cannot run here
            sessions.append(self._engine_for(d))
            granularity = max(granularity, sessions[-1].alignment)
        if not all(s.engine.pool_settled for s in sessions) and (
                not plan.usable or _bounced(plan.items, min(s.engine.block_size for s in sessions))):
            self._engines.settle_early(sessions)  # while DCP plans, not in the first write
        self._save_token = None
        if not plan.usable:
            # DCP's plan caching: this rank's items are those of its last
            # usable plan; the coordinator answers with an assignment naming
            # them (see fp_dcp.save.plan).
            return plan
        info = describe_rank(
            self.rank, socket.gethostname(), list(plan.items),
            n_dirs=len(dirs), granularity=granularity, small_bytes=self.options.pack_threshold_bytes,
        )
        self._save_token = info.token
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with self._gc.thaw_on_error():
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._lock.acquire(self._directory())
        self._world_size = len(plans)
        for rank, p in enumerate(plans):
            if p.usable and (not isinstance(p.storage_data, RankHoldings) or p.storage_data.holdings is None):
                raise RuntimeError(
                    f"FastPersistWriter.prepare_global_plan: rank {rank}'s plan did not pass through its "
                    f"prepare_local_plan (a custom save function, or a planner that drops storage_data?)"
                )
        assignments, record, self.last_plan = assign(
            self.save_id, [p.storage_data if p.usable else None for p in plans]
        )
        if record is not None:
            self._pending_record = record
        assignments = self._recycle_into(assignments)
        # A cached (empty) plan gets a usable stub: DCP's finish_plan then
        # hands write_data this save's assignment (this save's save_id)
        # instead of the final plan it cached from an earlier save.
        return [
            dataclasses.replace(p, storage_data=a) if p.usable else SavePlan([], storage_data=a, usable=True)
            for p, a in zip(plans, assignments)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # (the future's value is a RankResults: a sequence of WriteResult,
        # which DCP gathers on the coordinator and hands to finish)
        assignment = plan.storage_data
        if not isinstance(assignment, Assignment) or (assignment.pieces is None and not assignment.reuse):
            raise RuntimeError(
                "FastPersistWriter.write_data got a plan that did not pass through its "
                "prepare_global_plan (a custom save function?)"
            )
        fut: Future[Any] = Future()
        self.recycle = None  # (every rank's: the coordinator's was this save's, and is spent)
        # The pieces name this rank's own items (those of prepare_local_plan,
        # including the ones the planner's dedup removed from plan.items).
        try:
            # the plans, items and metadata made since set-up live to the end:
            # frozen too, the collections the write triggers do not walk them
            self._gc.refreeze()
            cache_key = _dcp_hooks.planner_cache_key(planner)
            assignment, items = assignment_items(assignment, self.rank, cache_key, self._save_token)
            record, self._pending_record = self._pending_record, None
            if cache_key is not None and record is not None:
                keep_global_record(record)
            # (the early settle of the bounce buffers may still run: the
            # engine calls take each buffer as it is faulted in; the settle
            # is joined when the writes end, so nothing of a save outlives it)
            try:
                fut.set_result(self._write(assignment, items, planner))
            finally:
                self._engines.settled()
        except BaseException:
            commit.abandon_rank_files(self._data_directories(), assignment.save_id, assignment.rank)
            self._lock.release()
            self._gc.thaw()
            raise
        if not self.is_coordinator:
            self._gc.thaw()
        return fut

    def _write(self, assignment: Assignment, items: list[WriteItem], planner: SavePlanner) -> RankResults:
        self._prepared = None
        # The coordinator encodes the metadata's structure while the last of
        # its data is written (the engines release the GIL; a thread of its
        # own would hold the GIL in json.dumps while the first batch is
        # resolved) and prepares the rest of the commit as soon as its results
        # are known: while its last batch is written, or while the files are synced.
        metadata = _dcp_hooks.planner_metadata(planner) if self.is_coordinator else None
        prepare_seconds = 0.0
        structure: fmt.EncodedStructure | None = None

        def encode_structure() -> None:
            nonlocal prepare_seconds, structure
            assert metadata is not None  # encoded on the coordinator only
            t0 = time.perf_counter()
            try:
                with paused():
                    structure = fmt.encode_structure(metadata)
            except Exception:
                pass  # finish does it again, and reports the error
            finally:
                prepare_seconds += time.perf_counter() - t0

        def prepare_commit(results: RankResults) -> None:
            nonlocal prepare_seconds
            assert metadata is not None
            if structure is None:
                return
            t0 = time.perf_counter()
            layout = blob = None
            try:
                if self._world_size == 1:  # these results are all finish will get
                    layout, blob = self._layout_and_metadata(metadata, [results], structure)
            except Exception:
                return  # finish does it again, and reports the error
            self._prepared = _PreparedCommit(metadata, metadata.state_dict_metadata, metadata.planner_data,
                                             structure, results, layout, blob)
            prepare_seconds += time.perf_counter() - t0

        out, self.last_stats = execute.write_rank(
            assignment,
            items,
            planner.resolve_data,
            dirs=self._data_directories(),
            session_for=self._engine_for,
            tag_devices=bool(self.data_dirs),
            options=self.options,
            while_writing=None if metadata is None else encode_structure,
            with_results=None if metadata is None else prepare_commit,
        )
        if metadata is not None:
            self.last_stats["prepare_commit_seconds"] = prepare_seconds
        return out

    def _layout_and_metadata(
        self, metadata: Metadata, results: Sequence[Sequence[WriteResult]],
        structure: fmt.EncodedStructure | None = None
    ) -> tuple[fmt.StorageLayout, bytes]:
        """The storage layout of every rank's ``results`` (checked against
        ``metadata``) and the bytes of the metadata file (``structure``:
        ``metadata``'s, encoded already)."""
        with paused():  # thousands of objects (extents, the JSON document), no cyclic garbage
            if structure is None:
                structure = fmt.encode_structure(metadata)
            layout = layout_from_results(results, self.save_id, self._engine().alignment)
            check_layout_covers(metadata, layout, structure)
            metadata.storage_meta = self.storage_meta()
            metadata.version = _DCP_VERSION  # as DCP's own writer records it
            blob = fmt.encode_metadata(
                metadata,
                layout,
                {
                    "writer": f"fp_dcp {fp_dcp.__version__}",
                    "torch_version": torch.__version__,
                    "created": time.time(),
                    "world_size": len(results),
                },
                structure,
            )
        return layout, blob

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t0 = time.perf_counter()
        directory = self._directory()
        prepared, self._prepared = self._prepared, None
        try:
            if prepared is None or not prepared.made_from(metadata):
                layout, blob = self._layout_and_metadata(metadata, results)
            elif (prepared.blob is not None and prepared.layout is not None and len(results) == 1
                  and results[0] is prepared.results):
                layout, blob = prepared.layout, prepared.blob  # metadata.storage_meta set there too
            else:
                layout, blob = self._layout_and_metadata(metadata, results, prepared.structure)
            files = [name for name, _ in layout.files]
            with Root(directory) as root:  # one descriptor: commit and clean-up in the same directory
                commit.commit_metadata(root, blob, layout.save_id, files, self.options.sync_files)
                commit.remove_superseded(root, self._data_directories(), files)
        finally:
            self._lock.release()
            self._end_retired()
            self._gc.thaw()
        metadata.storage_data = layout
        self.last_stats["finish_seconds"] = time.perf_counter() - t0

    def _recycle_into(self, assignments: list[Assignment]) -> list[Assignment]:
        """Retire this save's ``recycle`` checkpoint, if any, and name one of
        its data files in the assignment of each rank that takes one."""
        self._end_retired()
        old, self.recycle = self.recycle, None  # one save's
        if old is None or self.data_dirs:  # (data directories: files of several devices, not recycled)
            return assignments
        self._retired = recycling.retire(old, self._directory())
        if self._retired is None:
            return assignments
        written = [0 if a.pieces is None else int(a.pieces.length[a.pieces.device == 0].clip(0).sum())
                   for a in assignments]
        if not any(written):  # plans cached by DCP (their pieces are the ranks'): by rank
            written = [1] * len(assignments)
        taken = self._retired.assign(written)
        self.last_plan["recycled_files"] = sum(1 for t in taken if t)
        return [dataclasses.replace(a, recycle=t) if t else a for a, t in zip(assignments, taken)]

    def _end_retired(self) -> None:
        retired, self._retired = self._retired, None
        if retired is not None:
            retired.remove()

    def _directory(self) -> str:
        if self.path is None:
            raise ValueError(
                "FastPersistWriter has no path: pass FastPersistWriter(path) or dcp.save(..., checkpoint_id=path)"
            )
        return self.path

    def _data_directories(self) -> list[tuple[str, bool]]:
        return directories.data_directories(self._directory(), self.data_dirs)

    def _engine(self) -> IOSession:
        return self._engines.session(self.options, self._directory())

    def _engine_for(self, directory: str) -> IOSession:
        """The session of a data directory (that of the checkpoint directory
        is :meth:`_engine`'s)."""
        if directory == self._directory():
            return self._engine()
        return self._engines.for_directory(self.options, directory)

    def close(self) -> None:
        """Release the engine, its page-locked buffers and any lock now (after
        the async save in flight, if any, and the staging arena)."""
        self._close_staging()
        self._lock.release()
        self._end_retired()
        self._gc.thaw()
        self._engines.close()

    def __enter__(self) -> "FastPersistWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _bounced(items: list[WriteItem], block: int) -> bool:
    """Whether a write of ``items`` surely goes through the engine's bounce
    buffers: a bytes item or a tensor smaller than a request does.  (Larger
    tensors do where their memory is not page-aligned; a save of those alone
    settles the buffers in its first write.)"""
    for item in items:
        n = expected_nbytes(item)
        if n is None or n < block:
            return True
    return False


@dataclasses.dataclass(frozen=True)
class _PreparedCommit:
    """What the coordinator's ``write_data`` made for ``finish`` and what
    it was made from: the metadata's structure, and in a save of one rank
    (``blob`` not None) the layout of its ``results`` and the metadata's
    bytes."""

    metadata: Metadata
    state_dict_metadata: Any
    planner_data: Any
    structure: fmt.EncodedStructure
    results: RankResults  # the coordinator's own
    layout: fmt.StorageLayout | None
    blob: bytes | None

    def made_from(self, metadata: Metadata) -> bool:
        """Whether ``finish`` is handed the very metadata (DCP passes the
        planner's; nothing changes it in between).  The layout and bytes
        serve it only with the very ``results`` list too (``finish``
        checks)."""
        return (
            metadata is self.metadata
            and metadata.state_dict_metadata is self.state_dict_metadata
            and metadata.planner_data is self.planner_data
        )
