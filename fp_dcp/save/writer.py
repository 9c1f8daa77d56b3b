"""``FastPersistWriter``: a DCP ``StorageWriter`` that writes at the disk's speed.

Call sequence (``torch.distributed.checkpoint.state_dict_saver``):

1. every rank: ``reset`` / ``set_up_storage_writer`` / ``prepare_local_plan``
   — records what this rank holds (every item and its size, its host, its
   data directories) in ``SavePlan.storage_data``, which survives the
   planner's dedup of replicated items;
2. coordinator: ``prepare_global_plan`` — names this save (``save_id``) and
   balances the bytes (:mod:`fp_dcp.save.balance`): replicated items are divided
   by byte range among all the ranks that hold them, each host's bytes are
   striped over its data directories; the placement is cached by structure,
   so the next save of the same state-dict structure skips it.  Each rank's
   plan carries its pieces ``(item, byte range, device)``, including pieces
   of items the planner's dedup removed from its plan.  With DCP's plan
   caching (``DefaultSavePlanner(enable_plan_caching=True)``) a rank whose
   plan did not change sends an empty plan: its items and the placement come
   from this process's records of the last save (``_LOCAL_ITEMS``,
   ``_LAST_GLOBAL``), and every rank still gets this save's ``save_id``;
3. every rank: ``write_data`` — lays its pieces out in one file per device
   (large extents aligned, small ones packed) and streams them through the
   native engine (O_DIRECT, queue of aligned requests, zero-copy where the
   source is aligned, page-locked double buffers for CUDA tensors);
4. coordinator: ``finish`` — writes the metadata through a temporary name and
   a rename (the commit), syncs the directory, then removes the data files of
   the checkpoint it superseded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import gc
import io
import os
import secrets
import socket
import stat
import time
import weakref
from torch.futures import Future
from typing import Any, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

import fp_dcp
from fp_dcp import _native, _dcp_hooks
from fp_dcp.save import balance
from fp_dcp import format as fmt
from fp_dcp.checksums import crc_hex, merge_block_crcs, piece_checksums
from fp_dcp.engine import IOSession, PinnedBuffer, tensor_bytes
from fp_dcp.save.layout import align_up, place_extents
from fp_dcp.options import FastPersistOptions
from fp_dcp.staging import AsyncStagingMixin, forget_staged_checksums, staged_checksums

__all__ = ["FastPersistWriter"]


# Placements by structure (fp_dcp.save.balance.structure_key), shared by the
# writers of this process: a training loop that builds a new writer for each
# save still plans once.
_PLAN_CACHE = balance.PlanCache(capacity=8)

# DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``):
# a rank whose local plan did not change sends DCP an empty plan
# (``usable=False``), so its ``prepare_local_plan`` sees no items, and the
# coordinator's ``prepare_global_plan`` sees an empty plan for each such
# rank (DCP keeps its caches per planner class, in the process).  Per-process
# records fill the gap:
#
# * on every rank, ``_LOCAL_ITEMS``: the items each usable
#   ``prepare_local_plan`` recorded, under a token that travels in
#   ``_LocalInfo`` and comes back in that rank's ``_Assignment`` (the pieces
#   index those items); and ``_RANK_LAST``: per planner class (DCP's cache
#   key), the assignment this rank last wrote with;
# * on the coordinator, ``_LAST_GLOBAL``: per world size, the last
#   ``_LocalInfo`` seen for each rank and the placement made from them.
#
# Nothing changed anywhere (every plan empty): the coordinator answers each
# rank with a stub ``_Assignment(reuse=True)`` carrying this save's
# ``save_id`` only, and each rank writes with its own last assignment for
# this planner class (``_RANK_LAST``).  Some ranks changed: the coordinator
# plans with its record for the others and answers them with a stub carrying
# a full assignment.  Either way every plan it returns is usable, so DCP's
# ``finish_plan`` hands ``write_data`` this save's assignment, never the
# final plan it cached from an earlier save, and no rank ever writes under
# an earlier save's file names.
_LOCAL_ITEMS_CAPACITY = 16
_LOCAL_ITEMS: "collections.OrderedDict[str, list[WriteItem]]" = collections.OrderedDict()
_RANK_LAST: dict[tuple[int, str], "_Assignment"] = {}  # (rank, planner class) -> last assignment written


@dataclasses.dataclass
class _GlobalRecord:
    infos: list  # list[_LocalInfo], by rank
    key: str
    placement: Any


_LAST_GLOBAL: dict[int, _GlobalRecord] = {}  # world size -> record of the last save through a caching planner


def _remember_local_items(rank: int, items: list[WriteItem]) -> str:
    token = secrets.token_hex(8)
    _LOCAL_ITEMS[token] = items
    if len(_LOCAL_ITEMS) > _LOCAL_ITEMS_CAPACITY:
        # the oldest first, but never those a planner's cache still stands for
        pinned = {a.token for a in _RANK_LAST.values()} | {token}
        for old in [t for t in _LOCAL_ITEMS if t not in pinned][: len(_LOCAL_ITEMS) - _LOCAL_ITEMS_CAPACITY]:
            del _LOCAL_ITEMS[old]
    return token


def clear_plan_records() -> None:
    """Forget the per-process records that serve DCP's plan caching (tests;
    or after ``SavePlanner``'s class-level caches were cleared)."""
    _LOCAL_ITEMS.clear()
    _RANK_LAST.clear()
    _LAST_GLOBAL.clear()


@dataclasses.dataclass(frozen=True)
class _LocalInfo:
    """What ``prepare_local_plan`` records for the coordinator: every item
    this rank holds (``holdings``: keys and byte sizes, in plan order) and
    its host and number of data directories."""

    rank: int
    host: str
    holdings: balance.Holdings | None = None
    token: str = ""  # key of these items in this rank's _LOCAL_ITEMS


@dataclasses.dataclass(frozen=True)
class _Assignment:
    """What ``prepare_global_plan`` hands each rank: its pieces (byte ranges
    of items it holds, by position in its ``prepare_local_plan`` items, and
    the data directory of each), under this save's ``save_id``."""

    save_id: str
    rank: int
    pieces: balance.RankPieces | None = None
    n_items: int = 0
    plan_key: str = ""
    token: str = ""  # the rank's _LocalInfo.token these pieces index
    reuse: bool = False  # DCP cached everything: write with this rank's last assignment (save_id aside)


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: where an item's bytes went.

    ``extents`` holds ``(file_name, file_offset, item_offset, length,
    crc32c)`` (``crc32c``: ``fmt.Extent.crc32c``, or None) (a
    rank may write several byte ranges of an item, and several ranks parts
    of one item: each rank sends one result per item it wrote, and
    ``finish`` merges them); ``file_name`` is a plain name in the checkpoint
    directory or an absolute path in a data directory; ``file_sizes`` is set
    on one result per file: its size on disk."""

    extents: tuple[tuple[str, int, int, int, str | None], ...]
    file_sizes: tuple[tuple[str, int], ...] = ()


def _item_name(item: WriteItem) -> str:
    if item.index.offset is not None and item.type == WriteItemType.SHARD:
        return f"{item.index.fqn} (shard at {list(item.index.offset)})"
    return item.index.fqn


def _expected_nbytes(item: WriteItem) -> int | None:
    td = item.tensor_data
    if td is None:
        return None
    return int(np.prod(td.chunk.sizes, dtype=np.int64)) * td.properties.dtype.itemsize


class FastPersistWriter(AsyncStagingMixin, StorageWriter):
    """Write a DCP checkpoint into the directory ``path``.

    ``options`` is a :class:`~fp_dcp.FastPersistOptions`; keyword arguments
    are shorthand for its fields (``FastPersistWriter(path, engine="uring")``).
    One writer serves a series of saves: DCP calls :meth:`reset` with a new
    ``checkpoint_id`` (a directory) before each; the engine and its buffers
    are kept between saves.  Call :meth:`close` (or use ``with``) to release
    them at once.

    After each save, :attr:`last_stats` holds what happened on this rank:
    engine, bytes, seconds, throughput; on the coordinator
    :attr:`last_plan` describes the placement (balance, planning seconds,
    whether it came from the cache).

    With several ranks, the bytes of replicated items are divided among all
    the ranks that hold them and each host's bytes are striped over
    ``options.data_dirs`` (one directory per storage device; by default the
    data files go in ``path``).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        options: FastPersistOptions | None = None,
        **option_kwargs: Any,
    ) -> None:
        super().__init__()
        base = options if options is not None else FastPersistOptions.from_env()
        self.options = base.replace(**option_kwargs) if option_kwargs else base
        self.path = None if path is None else os.fspath(path)
        self.data_dirs = _data_dirs_option(self.options.data_dirs)
        a = self.options.split_alignment_bytes
        if a <= 0 or a & (a - 1):
            raise ValueError(f"FastPersistOptions.split_alignment_bytes must be a power of two, got {a}")
        self.last_plan: dict[str, Any] = {}
        self._sessions: dict[str, IOSession] = {}
        self.save_id = self._new_save_id()
        self._save_token: str | None = None  # this save's _LOCAL_ITEMS token (None: DCP sent a cached plan)
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: dict[str, Any] = {}
        self._session: IOSession | None = None
        self._lock_fd: int | None = None
        self._gc_frozen = False

    # ----------------------------------------------------------- DCP protocol

    @staticmethod
    def _new_save_id() -> str:
        return time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(4)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._release_lock()
        self._thaw_gc()  # a save that failed part-way left it frozen
        self.save_id = self._new_save_id()
        self.last_stats = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = 0 if rank is None else int(rank)
        self._freeze_gc()

    # A state dict of thousands of tensors makes every full collection of the
    # cyclic GC walk all of them; DCP's planning and our finish allocate enough
    # to trigger several per save (measured: 0.5 s of a 2.2 s save of 9,245
    # tensors).  gc.freeze() moves the objects that exist when the save starts
    # out of the collector's sight for the save's duration only; what the save
    # allocates is still collected.  Thawed at the end of this rank's part of
    # the save (write_data, or finish on the coordinator), and by reset() and
    # close() if a save failed in between (our own steps thaw on their own
    # errors; a failure inside DCP between them — another rank's error raised
    # here — leaves it frozen until this writer's next save, close() or
    # collection: the frozen objects are the long-lived ones of the job).

    def _freeze_gc(self) -> None:
        if self.options.freeze_gc_during_save and not self._gc_frozen and gc.get_freeze_count() == 0:
            gc.freeze()
            self._gc_frozen = True
            # made after the freeze: it stays out of the permanent generation
            # unless something else calls gc.freeze() before the thaw
            self._gc_sentinel = [self.path]
            self._gc_finalizer = weakref.finalize(self, _thaw_if_ours, self._gc_sentinel)

    def _thaw_gc(self) -> None:
        if self._gc_frozen:
            self._gc_frozen = False
            self._gc_finalizer.detach()
            _thaw_if_ours(self._gc_sentinel)

    @contextlib.contextmanager
    def _thaw_gc_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._thaw_gc()
            raise

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with self._thaw_gc_on_error():
            return self._prepare_local_plan(plan)

    def _prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        directory = self._directory()
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"cannot create the checkpoint directory: {e.strerror}", directory) from None
        if not os.path.isdir(directory):
            raise NotADirectoryError(20, "the checkpoint path exists and is not a directory", directory)
        if not self.options.overwrite and os.path.exists(os.path.join(directory, fmt.METADATA_NAME)):
            raise FileExistsError(
                17,
                "a committed fp_dcp checkpoint is already there and overwrite=False; "
                "pass another path or FastPersistOptions(overwrite=True)",
                directory,
            )
        granularity = self.options.split_alignment_bytes
        dirs = self._data_directories()
        for d, by_path in dirs:
            try:
                if by_path and not os.path.lexists(d):
                    os.makedirs(d, exist_ok=True)
                    if self.options.sync_files:
                        _fsync_dir(os.path.dirname(d))
                if by_path and not stat.S_ISDIR(os.lstat(d).st_mode):
                    # fp_dcp creates this sub-directory: a link planted in its
                    # place would lead the writes and the clean-up elsewhere
                    raise OSError(errno.ENOTDIR, "this checkpoint's sub-directory of a data directory is a "
                                  "symbolic link or not a directory (fp_dcp creates a real one); remove it", d)
            except OSError as e:
                raise type(e)(e.errno, f"cannot use the data directory: {e.strerror}", d) from None
            # fail before any rank writes if the engine cannot run here
            granularity = max(granularity, self._engine_for(d).alignment)
        self._save_token = None
        if not plan.usable:
            # DCP's plan caching: this rank's items are those of its last
            # usable plan; the coordinator answers with an assignment naming
            # them (see _LOCAL_ITEMS).
            return plan
        items = list(plan.items)
        token = self._save_token = _remember_local_items(self.rank, items)
        sizes = []
        for item in items:
            n = None if item.type == WriteItemType.BYTE_IO else _expected_nbytes(item)
            sizes.append(balance.UNSIZED if n is None else n)
        host = socket.gethostname()
        holdings = balance.make_holdings(
            self.rank,
            host,
            [balance.item_key(it.index.fqn, it.index.offset) for it in items],
            sizes,
            n_dirs=len(dirs),
            granularity=granularity,
            small_bytes=self.options.pack_threshold_bytes,
        )
        return dataclasses.replace(plan, storage_data=_LocalInfo(self.rank, host, holdings, token))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with self._thaw_gc_on_error():
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._acquire_lock()
        t0 = time.perf_counter()
        if not any(plan.usable for plan in plans):
            # DCP cached everything: each rank writes with its last
            # assignment for this planner; only the save_id is new.
            self.last_plan = {"cached": True, "dcp_cached": True, "seconds": time.perf_counter() - t0,
                              "ranks": len(plans)}
            return [
                SavePlan([], storage_data=_Assignment(self.save_id, rank, reuse=True), usable=True)
                for rank in range(len(plans))
            ]
        record = _LAST_GLOBAL.get(len(plans))
        infos: list[_LocalInfo] = []
        for rank, plan in enumerate(plans):
            if not plan.usable:
                # DCP's plan caching: nothing changed on this rank since the
                # last save through this planner; its items are the last ones
                # this process saw from it.
                if record is None:
                    raise RuntimeError(
                        f"FastPersistWriter.prepare_global_plan: DCP's plan caching sent a cached (empty) plan for "
                        f"rank {rank}, but no earlier save of this process went through a FastPersistWriter with "
                        f"{len(plans)} rank(s) (was the planner's cache filled by a save through another storage "
                        f"writer?); save once with a planner without plan caching, or clear SavePlanner's caches"
                    )
                infos.append(record.infos[rank])
                continue
            info = plan.storage_data
            if not isinstance(info, _LocalInfo) or info.holdings is None:
                raise RuntimeError(
                    f"FastPersistWriter.prepare_global_plan: rank {rank}'s plan did not pass through its "
                    f"prepare_local_plan (a custom save function, or a planner that drops storage_data?)"
                )
            infos.append(info)
        holdings = [info.holdings for info in infos]
        key = balance.structure_key(holdings)
        placement = _PLAN_CACHE.get(key)
        cached = placement is not None
        if placement is None:
            placement = balance.plan_placement(holdings)
            _PLAN_CACHE.put(key, placement)
        self._pending_record = _GlobalRecord(infos, key, placement)  # kept by write_data if the planner caches
        self.last_plan = {
            "cached": cached,
            "dcp_cached": False,
            "seconds": time.perf_counter() - t0,
            "ranks": len(plans),
            "items": placement.items,
            "bytes": placement.total_bytes,
            "balance": placement.balance(),
            "rank_bytes": placement.loads.tolist(),
            "device_bytes": {h: v.tolist() for h, v in placement.device_loads.items()},
        }
        out = []
        for rank, plan in enumerate(plans):
            info = infos[rank]
            assignment = _Assignment(
                self.save_id, rank, placement.pieces[rank], len(info.holdings.keys), key, info.token
            )
            if plan.usable:
                out.append(dataclasses.replace(plan, storage_data=assignment))
            else:
                # A usable stub: DCP's finish_plan then hands write_data this
                # assignment (this save's save_id) instead of the final plan
                # it cached from an earlier save.  Its items are not needed.
                out.append(SavePlan([], storage_data=assignment, usable=True))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = plan.storage_data
        if not isinstance(assignment, _Assignment) or (assignment.pieces is None and not assignment.reuse):
            raise RuntimeError(
                "FastPersistWriter.write_data got a plan that did not pass through its "
                "prepare_global_plan (a custom save function?)"
            )
        fut: Future[list[WriteResult]] = Future()
        # The pieces name this rank's own items (those of prepare_local_plan,
        # including the ones the planner's dedup removed from plan.items).
        try:
            cache_key = _dcp_hooks.planner_cache_key(planner)
            assignment, items = self._items_of(assignment, cache_key)
            record = self.__dict__.pop("_pending_record", None)
            if cache_key is not None and record is not None:
                _LAST_GLOBAL[len(record.infos)] = record
            fut.set_result(self._write(assignment, items, planner))
        except BaseException:
            self._abandon(assignment.save_id, assignment.rank)
            self._thaw_gc()
            raise
        if not self.is_coordinator:
            self._thaw_gc()
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t0 = time.perf_counter()
        directory = self._directory()
        try:
            layout = self._layout_from_results(results)
            _check_layout_covers(metadata, layout)
            metadata.storage_meta = self.storage_meta()
            blob = fmt.encode_metadata(
                metadata,
                layout,
                {
                    "writer": f"fp_dcp {fp_dcp.__version__}",
                    "torch_version": torch.__version__,
                    "created": time.time(),
                    "world_size": len(results),
                },
            )
            final = os.path.join(directory, fmt.METADATA_NAME)
            tmp = f"{final}.{layout.save_id}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                if self.options.sync_files:
                    os.fsync(fd)
            except BaseException as e:
                os.close(fd)
                self._abandon_commit(tmp, layout)
                if isinstance(e, OSError) and e.filename is None:  # os.write/fsync name no file
                    raise type(e)(e.errno, f"cannot write the checkpoint metadata: {e.strerror}", tmp) from None
                raise
            os.close(fd)
            if self.options.sync_files:
                # the data files' and the temporary metadata's entries reach the
                # disk before the rename can: a crash never leaves a committed
                # metadata file whose data files' names were lost
                _fsync_dir(directory)
            try:
                os.replace(tmp, final)  # the commit point
            except BaseException:
                self._abandon_commit(tmp, layout)
                raise
            if self.options.sync_files:
                _fsync_dir(directory)
            self._remove_superseded(directory, {name for name, _ in layout.files})
            for data_dir, by_path in self._data_directories():  # this checkpoint's sub-directories
                if by_path and os.path.isdir(data_dir):
                    keep = {os.path.basename(n) for n, _ in layout.files if os.path.dirname(n) == data_dir}
                    self._remove_superseded(data_dir, keep)
        finally:
            self._release_lock()
            self._thaw_gc()
        metadata.storage_data = layout
        self.last_stats["finish_seconds"] = time.perf_counter() - t0

    # ------------------------------------------------------------- internals

    def _items_of(self, assignment: _Assignment, planner_key: str | None) -> tuple[_Assignment, list[WriteItem]]:
        """This save's assignment and the items its pieces index: those this
        rank recorded under ``assignment.token`` (its last usable local plan,
        or, with DCP's plan caching, an earlier one the coordinator still
        describes), or with ``reuse`` this rank's last assignment for the
        planner class ``planner_key`` (DCP's cache key)."""
        way_out = ("save once with a planner without plan caching (or clear SavePlanner's class-level "
                   "caches)")
        if assignment.reuse:
            last = None if planner_key is None else _RANK_LAST.get((self.rank, planner_key))
            if last is None:
                raise RuntimeError(
                    f"rank {self.rank}: DCP's plan caching ({planner_key}) reports nothing changed since the "
                    f"last save, but no earlier save of this process through that planner went through a "
                    f"FastPersistWriter (the planner's cache was filled through another storage writer?); "
                    + way_out
                )
            assignment = dataclasses.replace(last, save_id=assignment.save_id, reuse=False)
        items = _LOCAL_ITEMS.get(assignment.token)
        if items is None:
            raise RuntimeError(
                f"rank {self.rank}: the global plan refers to local items this process no longer holds "
                f"(DCP's plan caching across more than {_LOCAL_ITEMS_CAPACITY} state-dict structures, or a "
                f"plan made in another process); " + way_out
            )
        # What this rank holds now: this save's items, or (DCP sent nothing
        # from it) those of its last save through this planner.
        last = None if planner_key is None else _RANK_LAST.get((self.rank, planner_key))
        reference = self._save_token or (last.token if last is not None else None)
        if reference is not None and reference != assignment.token and reference in _LOCAL_ITEMS:
            # The coordinator planned with an older record of this rank (DCP
            # sent it no news: this rank's global items had not changed, or
            # another planner's save came between).  Every item it assigns
            # to this rank must still be here, same size.
            now = {
                balance.item_key(it.index.fqn, it.index.offset): _expected_nbytes(it)
                for it in _LOCAL_ITEMS[reference]
            }
            for li in set(assignment.pieces.local.tolist()):
                it = items[li]
                k = balance.item_key(it.index.fqn, it.index.offset)
                if k not in now or now[k] != _expected_nbytes(it):
                    raise RuntimeError(
                        f"rank {self.rank}: DCP's plan caching kept a global plan that assigns "
                        f"{_item_name(it)} to this rank, which no longer holds it as planned; " + way_out
                    )
        if planner_key is not None:
            _RANK_LAST[(self.rank, planner_key)] = assignment
        return assignment, items

    def _directory(self) -> str:
        if self.path is None:
            raise ValueError(
                "FastPersistWriter has no path: pass FastPersistWriter(path) or dcp.save(..., checkpoint_id=path)"
            )
        return self.path

    def _engine(self) -> IOSession:
        directory = self._directory()
        if self._session is None or not self._session.matches(self.options, directory):
            if self._session is not None:
                self._session.close()
            self._session = IOSession(self.options, directory)
        return self._session

    def _engine_for(self, directory: str) -> IOSession:
        """The session of a data directory (that of the checkpoint directory
        is :meth:`_engine`'s)."""
        if directory == self._directory():
            return self._engine()
        session = self._sessions.get(directory)
        if session is None or not session.matches(self.options, directory):
            if session is not None:
                session.close()
            session = self._sessions[directory] = IOSession(self.options, directory)
        return session

    def _data_directories(self) -> list[tuple[str, bool]]:
        """``(directory, named by absolute path)`` of each of this rank's
        devices: the checkpoint directory by default; with
        ``options.data_dirs``, a sub-directory of each named after the
        checkpoint (so one data directory can serve many checkpoints, and
        cleaning up after a save touches only this checkpoint's files)."""
        directory = self._directory()
        if not self.data_dirs:
            return [(directory, False)]
        out = []
        real = os.path.realpath(directory)
        for d in self.data_dirs:
            if os.path.realpath(d) == real:
                out.append((directory, False))
            else:
                out.append((os.path.join(d, fmt.data_subdir_name(directory)), True))
        return out

    def _write(self, assignment: _Assignment, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        t0 = time.perf_counter()
        pieces = assignment.pieces
        assert pieces is not None
        if assignment.n_items != len(items):
            raise RuntimeError(
                f"rank {self.rank}: the global plan was made for {assignment.n_items} items of this rank, "
                f"but its prepare_local_plan recorded {len(items)} (was the writer reused by another save?)"
            )
        sources: dict[int, tuple[str, Any]] = {}

        def source(li: int) -> tuple[str, Any]:
            """("cpu", uint8 numpy array / memoryview) or ("cuda", flat uint8 tensor)."""
            if li in sources:
                return sources[li]
            item = items[li]
            data = planner.resolve_data(item)
            name = _item_name(item)
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"{name}: the planner resolved a bytes item to {type(data).__name__}, not BytesIO")
                out = ("cpu", data.getbuffer())
            else:
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"{name}: the planner resolved a tensor item to {type(data).__name__}")
                expected = _expected_nbytes(item)
                actual = data.numel() * data.element_size()
                if expected is not None and expected != actual:
                    raise ValueError(
                        f"{name}: the planner planned {expected} bytes but resolved a tensor of "
                        f"{actual} bytes ({tuple(data.shape)}, {data.dtype})"
                    )
                if data.device.type == "cuda":
                    t = data.detach()
                    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
                    out = ("cuda", flat)
                elif data.device.type == "cpu":
                    out = ("cpu", tensor_bytes(data, name))
                else:
                    out = ("cpu", tensor_bytes(data.detach().cpu(), name))
            sources[li] = out
            return out

        # device -> ([(item, item_offset, host bytes)], [(item, item_offset, CUDA bytes)])
        by_device: dict[int, tuple[list, list]] = {}
        for li, off, length, dev in zip(
            pieces.local.tolist(), pieces.offset.tolist(), pieces.length.tolist(), pieces.device.tolist()
        ):
            kind, buf = source(li)
            n = len(buf) if kind == "cpu" else int(buf.numel())
            if length == balance.UNSIZED:
                off, length = 0, n
            if off + length > n:
                raise RuntimeError(
                    f"{_item_name(items[li])}: the plan assigns bytes {off}..{off + length} of an item of {n} bytes"
                )
            by_device.setdefault(dev, ([], []))[0 if kind == "cpu" else 1].append((li, off, buf[off : off + length]))
        resolve_s = time.perf_counter() - t0

        dirs = self._data_directories()
        devices = sorted(by_device)
        if any(d >= len(dirs) for d in devices):
            raise RuntimeError(f"rank {self.rank}: the plan uses device {max(devices)} but this rank has {len(dirs)}")

        def write_device(dev: int):
            directory, by_path = dirs[dev]
            session = self._engine_for(directory)
            tag = dev if self.data_dirs else None
            cpu, cuda = by_device[dev]
            extents: list[tuple] = []  # (item, file, file_offset, item_offset, length, crc32c)
            file_sizes: list[tuple[str, int]] = []
            stats: dict[str, Any] = {"bytes": 0, "requests": 0, "staged_checksum_bytes": 0}
            for k, group in ((0, cpu), (1, cuda)):
                if not group:
                    continue
                name = fmt.data_file_name(assignment.save_id, assignment.rank, k, tag)
                path = os.path.join(directory, name)
                recorded = path if by_path else name
                if k == 0:
                    lengths = [len(b) for _, _, b in group]
                    offsets, end = place_extents(
                        lengths, session.alignment, self.options.pack_threshold_bytes, self.options.pack_alignment_bytes
                    )
                    # The staging copy may have checksummed these bytes already
                    # (an async save's arena): then the engine need not read them twice.
                    staged = [
                        _staged_crc_hex(source(li)[1], io_, len(b), used) if self.options.write_checksums else None
                        for li, io_, b in group
                    ]
                    # ... or most of them: the rest (pickled values, tensors
                    # the staging copy did not checksum) are checksummed here.
                    missing = [i for i, c in enumerate(staged) if c is None]
                    reuse = self.options.write_checksums and 2 * sum(lengths[i] for i in missing) <= sum(lengths)
                    if reuse:
                        for i in missing:
                            staged[i] = crc_hex(_native.crc32c_blocks(group[i][2], fmt.CHECKSUM_BLOCK_BYTES))
                    s = session.write(
                        [path],
                        np.zeros(len(group), dtype=np.int64),
                        np.asarray(offsets, dtype=np.int64),
                        [b for _, _, b in group],
                        sync=self.options.sync_files,
                        checksums=fmt.CHECKSUM_BLOCK_BYTES if self.options.write_checksums and not reuse else False,
                    )
                    _add_stats(stats, s)
                    if reuse:
                        crcs = staged
                        stats["staged_checksum_bytes"] += sum(lengths) - sum(lengths[i] for i in missing)
                    else:
                        crcs = piece_checksums(s, len(group)) if "crc32c" in s else [None] * len(group)
                else:
                    offsets, lengths, end, crcs = self._write_cuda(session, path, [b for _, _, b in group], stats)
                file_sizes.append((recorded, align_up(end, session.alignment)))
                extents += [
                    (li, recorded, fo, io_, n, crc)
                    for (li, io_, _), fo, n, crc in zip(group, offsets, lengths, crcs)
                ]
            if by_path and self.options.sync_files:
                _fsync_dir(directory)  # the new files' entries (the coordinator syncs the checkpoint directory)
            return extents, file_sizes, stats, session.kind, session.direct

        used: set[int] = set()  # arenas whose staging checksums this save used
        try:
            if len(devices) > 1:  # one thread per device: the engine releases the GIL
                with concurrent.futures.ThreadPoolExecutor(len(devices), thread_name_prefix="fp_dcp-device") as pool:
                    done = list(pool.map(write_device, devices))
            else:
                done = [write_device(d) for d in devices]
        finally:
            forget_staged_checksums(used)  # they belong to this save only

        stats: dict[str, Any] = {"engine": None, "direct_io": None, "bytes": 0, "requests": 0,
                                 "staged_checksum_bytes": 0}
        per_item: dict[int, list[tuple[str, int, int, int]]] = {}
        size_of: dict[str, int] = {}
        sizes_on: dict[int, list[tuple[str, int]]] = {}
        for extents, file_sizes, s, kind, direct in done:
            stats["engine"], stats["direct_io"] = kind, direct
            _add_stats(stats, s)
            size_of.update(file_sizes)
            for li, fname, fo, io_, n, crc in extents:
                per_item.setdefault(li, []).append((fname, fo, io_, n, crc))
        for fname in size_of:  # each file's size travels with one result
            li = min(li for li, exts in per_item.items() if any(e[0] == fname for e in exts))
            sizes_on.setdefault(li, []).append((fname, size_of[fname]))
        results = [
            WriteResult(
                index=items[li].index,
                size_in_bytes=sum(e[3] for e in exts),
                storage_data=_Written(extents=tuple(exts), file_sizes=tuple(sizes_on.get(li, ()))),
            )
            for li, exts in sorted(per_item.items())
        ]
        if stats["engine"] is None:  # nothing to write on this rank
            session = self._engine_for(dirs[0][0])
            stats["engine"], stats["direct_io"] = session.kind, session.direct
        seconds = time.perf_counter() - t0
        stats.update(
            seconds=seconds,
            resolve_seconds=resolve_s,
            gbps=stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
            items=len(per_item),
            pieces=len(pieces),
            devices=len(devices),
        )
        self.last_stats = stats
        return results

    def _write_cuda(
        self,
        session: IOSession,
        path: str,
        flat: list[torch.Tensor],
        stats: dict[str, Any],
    ) -> tuple[list[int], list[int], int, list[str | None]]:
        """Copy CUDA byte ranges (flat uint8 tensors) to the host through two
        page-locked buffers on a side stream, chunk by chunk, writing chunk k
        while chunk k+1 is copied.  Returns their file offsets, lengths, the
        end of the last one and their ``Extent.crc32c`` (the engine checksums
        each chunk's part of an extent on its grid; the parts are merged)."""
        align = session.alignment
        block = fmt.CHECKSUM_BLOCK_BYTES if self.options.write_checksums else 0
        lengths = [int(f.numel()) for f in flat]
        parts: list[list[tuple[int, int, Any]]] = [[] for _ in flat]  # per extent: (origin, length, crcs)

        def done(slot: int) -> None:
            fut, where = pending[slot]
            s = fut.result()
            _add_stats(stats, s)
            if block:
                first = s["crc32c_first"].tolist()
                for j, (i, origin, n) in enumerate(where):
                    parts[i].append((origin, n, s["crc32c"][first[j] : first[j + 1]]))

        # Every CUDA extent starts aligned, so chunk windows never share a block.
        offsets, end = place_extents(lengths, align, 0, align)
        chunk = align_up(min(self.options.cuda_chunk_bytes, max(end, align)), align)
        buffers = [PinnedBuffer(chunk, align) for _ in range(2)]
        device = flat[0].device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the tensors' producers first
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-cuda-write")
        fd = session.engine.open(path, "w", session.direct if session.direct else False)
        pending: list[tuple[concurrent.futures.Future, list[tuple[int, int, int]]] | None] = [None, None]
        try:
            for k, start in enumerate(range(0, align_up(end, align), chunk)):
                slot = k % 2
                if pending[slot] is not None:
                    done(slot)  # buffer free again
                    pending[slot] = None
                stop = start + chunk
                host = buffers[slot].tensor
                srcs, offs, where = [], [], []
                with torch.cuda.stream(stream):
                    for i, (f, off, n) in enumerate(zip(flat, offsets, lengths)):
                        a, b = max(off, start), min(off + n, stop)
                        if b <= a:
                            continue
                        host[a - start : b - start].copy_(f[a - off : b - off], non_blocking=True)
                        srcs.append(memoryview(buffers[slot].raw)[a - start : b - start])
                        offs.append(a)
                        where.append((i, a - off, b - a))
                event = torch.cuda.Event()
                event.record(stream)
                event.synchronize()
                if srcs:
                    fut = pool.submit(
                        session.write_fds, [fd], [path], np.zeros(len(srcs), np.int64), np.asarray(offs, np.int64),
                        srcs, sync=False, checksums=block or False,
                        checksum_origin=np.asarray([o for _, o, _ in where], np.int64) if block else None,
                    )
                    pending[slot] = (fut, where)
            for slot in (0, 1):
                if pending[slot] is not None:
                    done(slot)
                    pending[slot] = None
            if self.options.sync_files:
                os.fdatasync(fd)
        finally:
            for p in pending:
                if p is not None:
                    p[0].exception()  # wait before the buffers go away
            pool.shutdown(wait=True)
            os.close(fd)
            pending = srcs = host = None  # drop the views before freeing the buffers
            for b in buffers:
                b.close()
        crcs = [crc_hex(merge_block_crcs(p, block)) if block else None for p in parts]
        return offsets, lengths, end, crcs

    def _layout_from_results(self, results: list[list[WriteResult]]) -> fmt.StorageLayout:
        files: dict[str, int] = {}
        sizes: dict[str, int] = {}
        extents: dict[Any, list[fmt.Extent]] = {}
        for rank_results in results:
            for wr in rank_results:
                written = wr.storage_data
                if not isinstance(written, _Written):
                    raise RuntimeError(f"{wr.index.fqn}: write result without an fp_dcp record")
                for fname, size in written.file_sizes:
                    sizes[fname] = size
                for fname, fo, io_, ln, *crc in written.extents:
                    fid = files.setdefault(fname, len(files))
                    extents.setdefault(wr.index, []).append(fmt.Extent(fid, fo, io_, ln, crc[0] if crc else None))
        for exts in extents.values():
            exts.sort(key=lambda e: e.item_offset)
        missing = [f for f in files if f not in sizes]
        if missing:
            raise RuntimeError(f"no size reported for data file(s) {missing}")
        return fmt.StorageLayout(
            save_id=self.save_id,
            alignment=self._engine().alignment,
            files=[(f, sizes[f]) for f in files],
            extents=extents,
            checksum_block_bytes=fmt.CHECKSUM_BLOCK_BYTES
            if any(e.crc32c is not None for exts in extents.values() for e in exts)
            else None,
        )

    def _remove_superseded(self, directory: str, keep: set[str]) -> None:
        """After the commit: data files of earlier saves and leftover
        temporary metadata are garbage (a crash before the commit leaves them)."""
        for entry in os.scandir(directory):
            n = entry.name
            stale_data = n.endswith(fmt.DATA_SUFFIX) and n not in keep
            stale_tmp = n.startswith(fmt.METADATA_NAME + ".") and n.endswith(".tmp")
            if stale_data or stale_tmp:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    def _abandon(self, save_id: str, rank: int) -> None:
        """After this rank failed to write its part of a save: remove the
        data files it created (a full disk gets its space back) and release
        the lock; the previous checkpoint was never touched."""
        prefix = f"{save_id}.r{rank}."
        for directory, _ in self._data_directories():
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(prefix) and entry.name.endswith(fmt.DATA_SUFFIX):
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
        self._release_lock()

    def _abandon_commit(self, tmp: str, layout: fmt.StorageLayout) -> None:
        """The commit failed before the rename: nothing refers to the new
        save's data files or to the temporary metadata; remove them."""
        for name in [tmp] + [os.path.join(self._directory(), n) for n, _ in layout.files]:
            try:
                os.unlink(name)
            except OSError:
                pass

    def _acquire_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = os.path.join(self._directory(), fmt.LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(
                11, "another fp_dcp save into this checkpoint directory is in progress; wait for it "
                "or save elsewhere", self._directory()
            ) from None
        self._lock_fd = fd
        # a writer dropped after a failed save (DCP never calls finish) must not keep the lock
        self._lock_finalizer = weakref.finalize(self, os.close, fd)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            self._lock_finalizer()  # closes the fd, once
            self._lock_fd = None

    def close(self) -> None:
        """Release the engine, its page-locked buffers and any lock now (after
        the async save in flight, if any, and the staging arena)."""
        self._close_staging()
        self._release_lock()
        self._thaw_gc()
        if self._session is not None:
            self._session.close()
            self._session = None
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()

    def __enter__(self) -> "FastPersistWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _staged_crc_hex(item: Any, offset: int, length: int, used: set[int]) -> str | None:
    """``Extent.crc32c`` of bytes ``offset..offset+length`` of an item whose
    bytes (``item``, the whole item) a staging copy checksummed, when the
    piece starts on that checksum grid and ends on it or at the item's end;
    else None.  Records the arena used in ``used``."""
    if length == 0:
        return crc_hex(np.zeros(1, dtype=np.uint32))  # as the engine reports an empty piece
    if not isinstance(item, np.ndarray):
        return None
    block = fmt.CHECKSUM_BLOCK_BYTES
    n = item.size
    if offset % block or (offset + length != n and length % block):
        return None
    hit = staged_checksums(item.__array_interface__["data"][0], n)
    if hit is None:
        return None
    base, crcs = hit
    used.add(base)
    first = offset // block
    return crc_hex(crcs[first : first - (-length // block)])


def _add_stats(stats: dict[str, Any], s: dict[str, Any]) -> None:
    stats["bytes"] += s.get("bytes", 0)
    stats["requests"] += s.get("requests", 0)
    stats["zero_copy_bytes"] = stats.get("zero_copy_bytes", 0) + s.get("zero_copy_bytes", 0)
    if "staged_checksum_bytes" in s:
        stats["staged_checksum_bytes"] = stats.get("staged_checksum_bytes", 0) + s["staged_checksum_bytes"]


def _data_dirs_option(value: Any) -> tuple[str, ...]:
    """``options.data_dirs`` as absolute paths: a sequence of paths, or one
    string of paths separated by ``os.pathsep`` (the environment's form)."""
    if value is None or value == "" or value == ():
        return ()
    if isinstance(value, (str, os.PathLike)):
        parts = [p for p in os.fspath(value).split(os.pathsep) if p.strip()]
    else:
        parts = [os.fspath(p) for p in value]
    dirs = tuple(os.path.abspath(p) for p in parts)
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(d)
        if real in seen:
            raise ValueError(
                f"FastPersistOptions.data_dirs names one directory twice ({seen[real]!r} and {d!r}): "
                f"give one directory per storage device"
            )
        seen[real] = d
    return dirs


def _check_layout_covers(metadata: Metadata, layout: fmt.StorageLayout) -> None:
    """Before the commit: every stored item's extents, merged from all ranks,
    tile its bytes exactly once (a tensor's size comes from the metadata; a
    bytes item must be gap-free from 0)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fp_dcp.save.layout import check_extents_cover

    for index, exts in layout.extents.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        nbytes = sum(e.length for e in exts)
        if isinstance(md, TensorStorageMetadata):
            esize = md.properties.dtype.itemsize
            for chunk in md.chunks:
                if index.offset is None or chunk.offsets == index.offset:
                    nbytes = int(np.prod(chunk.sizes, dtype=np.int64)) * esize
                    break
        try:
            check_extents_cover(index.fqn, exts, nbytes)
        except fmt.CheckpointFormatError as e:
            raise RuntimeError(f"fp_dcp wrote an inconsistent layout, refusing to commit it: {e}") from None
    stored = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in layout.extents}
    for fqn, md in metadata.state_dict_metadata.items():
        keys = [(fqn, tuple(c.offsets)) for c in md.chunks] if isinstance(md, TensorStorageMetadata) else [(fqn, None)]
        for key in keys:
            if key not in stored:
                raise RuntimeError(f"fp_dcp wrote no bytes for {key}, refusing to commit the checkpoint")


def _thaw_if_ours(sentinel: list) -> None:
    """``gc.unfreeze()``, unless something else froze objects since the save
    did: ``sentinel`` was made right after the save's ``gc.freeze()``, so it is
    still among the collector's generations (``gc.get_objects()``, which holds
    only what was made since the freeze and is small) unless another
    ``gc.freeze()`` moved it to the permanent generation.  Then the
    application froze objects of its own, which a global unfreeze would undo,
    and everything stays frozen (still freed by reference counting; only
    cycles among the frozen objects wait)."""
    if any(o is sentinel for o in gc.get_objects()):
        gc.unfreeze()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
