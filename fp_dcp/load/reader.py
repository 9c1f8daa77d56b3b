"""``FastPersistReader``: a DCP ``StorageReader`` that reads only the bytes each
rank needs, into any world size and sharding (Universal Checkpointing).

For every ``ReadItem`` (a box of a stored chunk that lands in a box of a
target tensor) the reader describes the bytes as a grid of runs contiguous in
both the stored chunk and the target (:func:`fp_dcp.load.plan.box_grid`), maps
them onto the stored extents (a chunk may be split over several files and
ranks), and decides — in Python, so the decision is the planner's, not the
engine's — how to read them:

* runs are read straight into the target tensor wherever it is a CPU tensor
  of the stored dtype (contiguous or not: a column slice is read row by row
  into its rows);
* many small runs whose gaps hold no whole alignment block (a dense slice of
  the last dimension) are read as a few ranges into a bounded temporary and
  moved with one strided copy, instead of one request and one Python object
  per run;
* targets of another dtype or device are read into a bounded temporary and
  cast with ``copy_``, as the stock reader does (``strict_dtype=True`` makes
  that an error);
* across items, gaps between pieces are read through only where that costs
  no whole block, or within the over-read budget
  (``max_overread_percent``); the engine is called with ``coalesce_gap=0``.

Temporaries never exceed ``read_buffer_budget_bytes`` (one arena, reused for
the whole load); a stored chunk is never read whole to be sliced.

With ``share_replicated_reads=True``, a box that several ranks need (every
rank of a DDP-style restart needs every replicated tensor) is read from disk
by one of them and sent to the others over the load's process group, inside
DCP's own ``read_data`` step: every rank runs the same sequence of
collectives, errors included.  With ``share_interleaved_reads`` (on by
default for a process group that moves tensors on the CPU, among the ranks
of one machine), stored rows that
several ranks need interleaved parts of (a load that moves the sharded
dimension) are cut into row slabs, each read whole and sequentially by
one rank, which sends every other rank its part: each rank reads about the
bytes it needs, in large requests, instead of many small runs.  Both are
*shared units* of one plan (:class:`_SharedUnit`): a box of a stored chunk,
its owner, and the sub-box each rank needs of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import threading
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fp_dcp import _native
from fp_dcp import format as fmt
from fp_dcp.load import objects
from fp_dcp.checksums import ReadVerifier
from fp_dcp.engine import IOSession, device_max_request_bytes, large_read_shape
from fp_dcp.files import read_checkpoint_metadata
from fp_dcp.save.layout import check_extents_cover
from fp_dcp.options import FastPersistOptions
from fp_dcp.load.plan import (
    box_runs,
    Grid,
    assign_owners,
    box_grid,
    interleaved_slabs,
    level_span,
    map_ranges,
    merge_level,
    plan_fillers,
    split_box,
    split_runs,
    strides_non_overlapping,
    unit_starts,
)

__all__ = ["FastPersistReader", "read_checkpoint_metadata"]

# Runs at least this long are always read straight into their target: the
# per-run cost (one memoryview, one engine piece) is negligible beside them.
_MERGE_RUN_MAX_BYTES = 64 << 10
# A sub-grid is read through a temporary only if it saves this many runs.
_MERGE_MIN_RUNS = 16
# Runs longer than this are cut, so one engine call (and one progress step)
# stays bounded.
_MAX_PIECE_BYTES = 64 << 20
# Bounds of one engine call.
_MAX_BATCH_PIECES = 1 << 20
_MAX_BATCH_BYTES = 1 << 30
_PROGRESS_BATCH_BYTES = 256 << 20
# The reader's engine when FastPersistOptions leave queue_depth and
# block_size_bytes to the engine (see FastPersistReader._engine).
_READ_QUEUE_DEPTH = 64
_READ_BLOCK_BYTES = 256 << 10
# Requests sized by what they move (issue 15): with the engine's shape left
# to fp_dcp, pieces at least this long (after the verifier's cuts) go to a
# second engine of large requests (engine.large_read_shape: the device's
# largest whole request, 4 MiB here, 8 in flight); shorter ones, scattered
# runs above all, stay on the one above, many small requests in flight.
# A 256 KiB request costs a device that charges per operation 16x the
# operations of a 4 MiB one: measured in docs/NATIVE.md, "Request sizes".
_LONG_RUN_BYTES = 1 << 20
# shared reads: rounds read from disk ahead of the one being exchanged
_READ_AHEAD = 2
_ZERO_START = np.zeros(1, dtype=np.int64)  # one run, from the address given


@dataclasses.dataclass(frozen=True)
class _Part:
    """The sub-box (``offsets``/``lengths``, chunk coordinates) of a shared
    unit that ``rank`` needs for its read item of the box
    ``item_offsets``/``item_lengths`` of the same stored chunk."""

    rank: int
    item_offsets: tuple[int, ...]
    item_lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _SharedUnit:
    """A box (``offsets``/``lengths``) of a stored chunk that ``owner`` reads
    from disk, and the ``parts`` of it that ranks need: the owner keeps its
    own and sends the others.  Replicated reads: every part is the whole box.
    Interleaved reads: the box is a row slab and each part a column band."""

    fqn: str
    chunk: tuple[int, ...] | None
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    owner: int
    parts: tuple[_Part, ...]

    def item_key(self, part: _Part) -> tuple:
        return (self.fqn, self.chunk, part.item_offsets, part.item_lengths)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(p.rank for p in self.parts))


@dataclasses.dataclass(frozen=True)
class _MachineInfo:
    """What a rank's local plan tells the coordinator (``storage_data``):
    the machine it runs on (:func:`_machine_id`)."""

    machine: int


@dataclasses.dataclass
class _SharePlan:
    """``LoadPlan.storage_data`` when reads are shared: the same list on every
    rank (the collectives follow it); ``rounds`` are ranges of ``units``;
    ``transport`` the coordinator's ``shared_read_transport``."""

    units: list[_SharedUnit]
    rounds: list[tuple[int, int]]
    transport: str = "process_group"


class FastPersistReader(StorageReader):
    """Load a checkpoint written by :class:`~fp_dcp.FastPersistWriter` from
    ``path``, into any world size and sharding.

    ``options`` / keyword arguments as for the writer; the reader's own are
    ``read_buffer_budget_bytes``, ``max_overread_percent``, ``strict_dtype``,
    ``share_replicated_reads``, ``share_interleaved_reads`` and
    ``coalesce_gap_bytes`` (see :class:`~fp_dcp.FastPersistOptions`).
    ``process_group``: the group passed to ``dcp.load`` when it is not the
    default one (used only by the two ``share_*`` options).

    After each load :attr:`last_stats` holds this rank's ``bytes`` (needed by
    its targets), ``bytes_read`` (read from disk, alignment included),
    ``requests``, ``pieces``, ``seconds`` and the engine; with sharing,
    ``shared_bytes_read`` (of shared units this rank read from disk for
    itself and others), ``shared_bytes_sent`` / ``shared_bytes_received``
    (``shared_bytes_pulled`` of them copied from a same-machine rank's
    memory), ``shared_rounds`` and ``shared_buffer_bytes`` (the rounds'
    buffers, within ``read_buffer_budget_bytes``).  Shared reads read two
    rounds at once with two engines: one more engine's bounce buffers
    (``queue_depth + 1`` blocks, page-locked), kept with the reader as the
    first engine is, until :meth:`close`.

    The engines are set up on a thread of their own from
    ``prepare_local_plan`` on, while DCP exchanges the plans, not when the
    first read needs them.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        options: FastPersistOptions | None = None,
        *,
        process_group: Any = None,
        **option_kwargs: Any,
    ) -> None:
        super().__init__()
        base = options if options is not None else FastPersistOptions.from_env()
        self.options = base.replace(**option_kwargs) if option_kwargs else base
        self.path = None if path is None else os.fspath(path)
        self.process_group = process_group
        self.load_id = secrets.token_hex(8)
        self.layout: fmt.StorageLayout | None = None
        self.state_dict_metadata: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self.progress: Callable[[int, int], None] | None = None  # (bytes done, bytes total), for tools
        self._session: IOSession | None = None
        self._twins: list[IOSession] = []  # the other engines of shared reads
        self._large: IOSession | None = None  # the engine of large requests (long runs)
        self._setting_up: threading.Thread | None = None
        self._ext_cache: dict[MetadataIndex, tuple[np.ndarray, ...]] = {}
        self._verifier: ReadVerifier | None = None
        self._use_collectives = True

    # ----------------------------------------------------------- DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = secrets.token_hex(8)
        self.layout = None
        self._ext_cache = {}
        self._verifier = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        return os.path.exists(os.path.join(os.fspath(checkpoint_id), fmt.METADATA_NAME))

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
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
        self._ext_cache = {}
        self._verifier = None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
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
            plan = dataclasses.replace(plan, storage_data=_MachineInfo(_machine_id()))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not (self.options.share_replicated_reads or self._interleave_wanted()) or len(plans) < 2:
            return plans
        share = self._plan_sharing(plans)
        if share is None:
            return plans
        return [dataclasses.replace(p, storage_data=share) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        self.last_stats = {}
        share = self._agreed_share_plan(plan)
        self._read(plan.items, planner, share)
        self.last_stats["seconds"] = time.perf_counter() - t0
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        self._engines_set_up()
        self._close_sessions()

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
        return _transfer_device(self.process_group).type == "cpu"

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
        try:
            sizes, _ = self._chunk_sizes(req.storage_index.fqn, list(req.storage_index.offset or ()))
        except fmt.CheckpointFormatError:
            return False  # the read reports it
        span = 1
        for d, (n, size) in enumerate(zip(lengths, sizes)):
            if d and n < size and span > 1:
                return True
            span *= n
        return False

    def _set_up_engines_early(self, twin: bool, bounce: bool = True) -> None:
        """Start setting the engine up (and, with ``twin``, the second engine
        of shared reads) on a thread of its own, while DCP plans the load.
        With ``bounce`` the engine's bounce buffers are faulted in and
        page-locked there too (tens of ms where the host faults memory in
        lazily, as on VMs with free-page reporting), which need not wait for
        the plan; the twin's are left to the first call that needs them
        (shared reads, into aligned temporaries, do not).  Best effort: a
        failure here is raised by the set-up ``read_data`` runs."""
        if self._setting_up is not None or self.path is None:
            return

        def work() -> None:
            try:
                session = self._engine()
                large = self._large_engine()
                if bounce:
                    session.engine.settle_pool()
                    if large is not None:
                        large.engine.settle_pool()
                if twin:
                    self._twin(0)
            except BaseException:  # noqa: BLE001 - read_data's own set-up reports it
                pass

        self._setting_up = threading.Thread(target=work, name="fp_dcp-reader-setup", daemon=True)
        self._setting_up.start()

    def _engines_set_up(self) -> None:
        """Wait for :meth:`_set_up_engines_early` (before touching the engines)."""
        if self._setting_up is not None:
            self._setting_up.join()
            self._setting_up = None

    def _twin(self, i: int) -> IOSession:
        """The ``i``-th other session for the current one (kept with the
        reader, as the first), for shared reads' reading threads: each
        thread its own engine."""
        session = self._engine()
        while len(self._twins) <= i:
            self._twins.append(session.twin())
        return self._twins[i]

    def _close_sessions(self) -> None:
        for session in [*self._twins, self._large, self._session]:
            if session is not None:
                session.close()
        self._session, self._twins, self._large = None, [], None

    def _large_engine(self) -> IOSession | None:
        """The engine of large requests for long runs, kept with the reader;
        None when the options set the engine's shape (they override the
        rule) or when the rule gives no larger request."""
        opts = self.options
        if opts.queue_depth is not None or opts.block_size_bytes is not None:
            return None
        session = self._engine()
        if self._large is None:
            block, qd = large_read_shape(device_max_request_bytes(self._directory()), session.alignment)
            if block <= _READ_BLOCK_BYTES:
                return None
            self._large = session.reshaped(qd, block)
        return self._large

    def _engine(self) -> IOSession:
        directory = self._directory()
        opts = self.options
        if opts.queue_depth is None and opts.block_size_bytes is None:
            # The reader's engine only reads: small runs (a column shard is one
            # run per row) need many requests in flight, and long runs go in
            # place or through the window anyway.  Same bounce memory as the
            # engine's defaults (qd+1 slots of one block).
            opts = opts.replace(queue_depth=_READ_QUEUE_DEPTH, block_size_bytes=_READ_BLOCK_BYTES)
        if self._session is None or not self._session.matches(opts, directory):
            self._close_sessions()
            self._session = IOSession(opts, directory)
        return self._session

    def _extents(self, fqn: str, chunk: Any, nbytes: int) -> tuple[np.ndarray, ...]:
        """The item's extents as arrays (item offsets, lengths, files, file offsets)."""
        assert self.layout is not None
        key = MetadataIndex(fqn, chunk)
        cached = self._ext_cache.get(key)
        if cached is not None:
            return cached
        exts = self.layout.extents.get(key)
        if exts is None:
            raise fmt.CheckpointFormatError(
                f"{self.path}: no stored bytes for {fqn}"
                + ("" if chunk is None else f" (chunk at {list(chunk)})")
                + "; the checkpoint metadata is inconsistent"
            )
        check_extents_cover(fqn, exts, nbytes)
        arrays = tuple(
            np.array([getattr(e, f) for e in exts], dtype=np.int64)
            for f in ("item_offset", "length", "file", "file_offset")
        )
        self._ext_cache[key] = arrays
        return arrays

    def _checksums(self, paths: list[str]) -> ReadVerifier | None:
        """The stored checksums laid out for checking reads (built once per
        checkpoint), or None when the checkpoint has none or checks are off."""
        if not self.options.verify_checksums:
            return None
        if self._verifier is None or self._verifier.paths != paths:
            assert self.layout is not None
            self._verifier = ReadVerifier(self.layout, paths)
        return self._verifier if self._verifier.enabled else None

    def _chunk_sizes(self, fqn: str, chunk: Any) -> tuple[list[int], torch.dtype]:
        md = self.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise fmt.CheckpointFormatError(f"{self.path}: {fqn} is not a tensor in the checkpoint")
        for c in md.chunks:
            if chunk is None or list(c.offsets) == list(chunk):
                return [int(s) for s in c.sizes], md.properties.dtype
        raise fmt.CheckpointFormatError(f"{self.path}: {fqn}: the checkpoint has no chunk at {list(chunk)}")

    # ----------------------------------------------------------- the load

    def _read(self, items: list[ReadItem], planner: LoadPlanner, share: _SharePlan | None) -> None:
        t0 = time.perf_counter()
        run: _Run | None = None
        setup_error: BaseException | None = None
        try:
            objects.check_bytes_targets(items, planner, str(self.path))  # before any byte is read
            self._engines_set_up()
            session = self._engine()
            directory = self._directory()
            assert self.layout is not None
            run = _Run(self, session, fmt.data_file_paths(directory, self.layout))
        except BaseException as e:  # noqa: BLE001
            if share is None:
                raise
            setup_error = e  # the other ranks learn it in the first round's collective
        try:
            if share is not None:
                t1 = time.perf_counter()
                items = _share_reads(self, run, items, planner, share, setup_error)
                assert run is not None
                run.stats["share_seconds"] = time.perf_counter() - t1
                t0 += run.stats["share_seconds"]
            assert run is not None
            jobs: list[_Job] = []
            for req in items:
                jobs.extend(self._plan_item(req, planner, run))
            run.stats["plan_seconds"] = time.perf_counter() - t0
            run.execute(jobs)
        finally:
            if run is not None:
                run.close()
        self.last_stats.update(run.stats)

    def _plan_item(self, req: ReadItem, planner: LoadPlanner, run: "_Run") -> list["_Job"]:
        fqn, chunk = req.storage_index.fqn, req.storage_index.offset
        if req.type == LoadItemType.BYTE_IO:
            assert self.layout is not None
            exts = self.layout.extents.get(MetadataIndex(fqn, chunk)) or []
            nbytes = sum(e.length for e in exts)
            arrays = self._extents(fqn, chunk, nbytes)
            buf = np.empty(nbytes, dtype=np.uint8)
            done = lambda: self._load_object(req, planner, buf.tobytes())  # noqa: E731
            if nbytes == 0:
                return [_Job.empty(done=done)]
            rng, within, files, offs, lens = map_ranges(np.zeros(1, np.int64), np.array([nbytes]), *arrays)
            return [_Job(files, offs, lens, within, buf=buf, needed=nbytes, done=done)]
        sizes, dtype = self._chunk_sizes(fqn, chunk)
        dest = self._target(req, planner, dtype)
        commit = lambda: planner.commit_tensor(req, dest)  # noqa: E731
        return self._plan_box(fqn, chunk, sizes, dtype, list(req.storage_offsets), list(req.lengths), dest, run, commit)

    def _load_object(self, req: ReadItem, planner: LoadPlanner, data: bytes) -> None:
        """A bytes item's object, rebuilt safely (:mod:`fp_dcp.load.objects`), to the planner."""
        key = req.storage_index.fqn
        obj = objects.load_object(data, key, str(self.path), self.options.allow_pickle)
        objects.deliver_object(planner, req, obj, data)

    def _target(self, req: ReadItem, planner: LoadPlanner, stored: torch.dtype) -> torch.Tensor:
        """The planner's target tensor of ``req``, checked: a tensor, its
        shape, and its dtype against ``strict_dtype``."""
        dest = planner.resolve_tensor(req)
        if not isinstance(dest, torch.Tensor):
            raise fmt.CheckpointFormatError(
                f"{self.path}: {req.storage_index.fqn!r} is stored as a tensor ({stored}), but the state dict "
                f"being loaded holds a {type(dest).__name__} under {req.dest_index.fqn!r}; refusing to load "
                f"a tensor into it"
            )
        dest = dest.detach()
        if list(dest.shape) != [int(n) for n in req.lengths]:
            raise ValueError(
                f"{req.dest_index.fqn}: the planner's target has shape {list(dest.shape)}, "
                f"the read needs {list(req.lengths)}"
            )
        self._check_dtype(req, stored, dest.dtype)
        return dest

    def _check_dtype(self, req: ReadItem, stored: torch.dtype, target: torch.dtype) -> None:
        if target != stored and self.options.strict_dtype:
            raise TypeError(
                f"{req.dest_index.fqn}: the checkpoint stores {req.storage_index.fqn} as {stored}, the "
                f"target tensor is {target}; FastPersistOptions.strict_dtype=True refuses to cast. Load "
                f"into a {stored} tensor, or set strict_dtype=False to cast as the stock reader does"
            )

    def _plan_box(self, fqn, chunk, sizes, dtype, offsets, lengths, dest, run, commit) -> list["_Job"]:
        """Jobs that read box ``offsets+lengths`` of a stored chunk into ``dest``."""
        esize = dtype.itemsize
        arrays = self._extents(fqn, chunk, math.prod(sizes) * esize)
        needed = math.prod(lengths) * esize
        if needed == 0:
            return [_Job.empty(done=commit)]
        in_place = (
            dest.device.type == "cpu"
            and dest.dtype == dtype
            and not dest.is_conj()
            and not dest.is_neg()
            and strides_non_overlapping(dest.shape, dest.stride())
        )
        if in_place:
            grid = box_grid(sizes, offsets, lengths, esize, dest.stride())
            buf = _storage_bytes(dest)
            level = self._merge_level(grid, run)
            if level is None:
                jobs = _direct_jobs(grid, arrays, buf, needed)
            else:
                jobs = _unit_jobs(grid, level, arrays, run, needed, _numpy_copier(buf, grid, level, esize))
            jobs[-1].add_done(commit)
            return jobs
        # another dtype or device, or a target that overlaps itself: through a
        # temporary, bounded by the budget, and copy_ (which casts).
        jobs = []
        dgrid = box_grid(sizes, offsets, lengths, esize, dest.stride())
        level = self._merge_level(dgrid, run) if strides_non_overlapping(dest.shape, dest.stride()) else None
        if level is not None:
            jobs = _unit_jobs(dgrid, level, arrays, run, needed, _torch_copier(dest, dtype, dgrid, level, run))
        else:
            for sub_off, sub_len in split_box(lengths, esize, run.cap):
                sub_needed = math.prod(sub_len) * esize
                grid = box_grid(sizes, [o + s for o, s in zip(offsets, sub_off)], sub_len, esize)
                target = dest[tuple(slice(s, s + n) for s, n in zip(sub_off, sub_len))]
                jobs.extend(_packed_temp_jobs(grid, arrays, sub_needed, target, dtype, run))
        jobs[-1].add_done(commit)
        return jobs

    def _merge_level(self, grid: Grid, run: "_Run") -> int | None:
        """The level at which sub-grids are read through a temporary, or None
        (runs straight into the target).  Gaps without a whole block are
        merged freely; gaps with whole blocks only within the over-read
        budget, which they then take from (the fillers get the rest)."""
        g = len(grid.counts)
        if g == 0 or grid.run >= _MERGE_RUN_MAX_BYTES:
            return None
        level, paid = merge_level(grid, run.alignment, self.options.max_overread_percent / 100)
        if level == g or math.prod(grid.counts[level:]) < _MERGE_MIN_RUNS:
            return None
        run.planned_paid += paid
        return level

    # ----------------------------------------------------------- sharing

    def _plan_sharing(self, plans: list[LoadPlan]) -> _SharePlan | None:
        """On the coordinator: the shared units of the load, each with one
        owner, in rounds bounded by the buffer budget.

        Per stored chunk, with ``share_interleaved_reads``: row slabs where the
        ranks' boxes are fragmented and together cover the rows
        (:func:`fp_dcp.load.plan.interleaved_slabs`); with
        ``share_replicated_reads``: boxes that several ranks need whole, cut to
        the budget.  Owners: the rank with the most of its quota left
        (:func:`fp_dcp.load.plan.assign_owners`), its quota being its share of
        the shared bytes in proportion to what it needs of them, so each rank
        reads about what it needs."""
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
        budget = opts.read_buffer_budget_bytes
        machines = [p.storage_data.machine if isinstance(p.storage_data, _MachineInfo) else None for p in plans]
        by_chunk: dict[tuple, dict[tuple, None]] = {}
        for rank, plan in enumerate(plans):
            for req in plan.items:
                if req.type != LoadItemType.TENSOR:
                    continue
                fqn, chunk, offsets, lengths = _read_key(req)
                by_chunk.setdefault((fqn, chunk), {})[(rank, offsets, lengths)] = None
        # (fqn, chunk, offsets, lengths, nbytes, parts) before owners are chosen
        pending: list[tuple] = []
        for fqn, chunk in sorted(by_chunk, key=lambda k: (k[0], k[1] or ())):
            md = self.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                continue
            esize = md.properties.dtype.itemsize
            boxes = list(by_chunk[(fqn, chunk)])
            rest = boxes
            if interleave:
                try:
                    sizes, _ = self._chunk_sizes(fqn, None if chunk is None else list(chunk))
                except fmt.CheckpointFormatError:
                    sizes = None  # the ranks' own reads report it
                slabs = [] if sizes is None else interleaved_slabs(
                    sizes, esize, boxes, max(1, budget // 16), run_max_bytes=_MERGE_RUN_MAX_BYTES)
                if opts.share_interleaved_reads is None and not all(
                        len(ms := {machines[boxes[i][0]] for i, _, _ in sl.parts}) == 1 and None not in ms
                        for sl in slabs):
                    # auto: a part would cross machines (or a rank did not
                    # say where it runs), and the process group's network may
                    # be slower than reading the runs: each rank reads its own
                    slabs = []
                for sl in slabs:
                    parts = tuple(_Part(boxes[i][0], boxes[i][1], boxes[i][2], tuple(o), tuple(n))
                                  for i, o, n in sl.parts)
                    pending.append((fqn, chunk, sl.offsets, sl.lengths, sl.nbytes, parts))
                if slabs:
                    rest = []
            if opts.share_replicated_reads:
                needers: dict[tuple, list[int]] = {}
                for rank, offsets, lengths in rest:
                    needers.setdefault((offsets, lengths), []).append(rank)
                for (offsets, lengths), ranks in sorted(needers.items()):
                    if len(ranks) < 2:
                        continue
                    for sub_off, sub_len in split_box(lengths, esize, max(1 << 20, budget // 8)):
                        offs = tuple(o + s for o, s in zip(offsets, sub_off))
                        lens = tuple(sub_len)
                        parts = tuple(_Part(r, offsets, lengths, offs, lens) for r in ranks)
                        pending.append((fqn, chunk, offs, lens, math.prod(lens) * esize, parts))
        if not pending:
            return None
        esizes = {fqn: self.state_dict_metadata[fqn].properties.dtype.itemsize for fqn, *_ in pending}
        need = [0] * len(plans)
        for fqn, _, _, _, _, parts in pending:
            for p in parts:
                need[p.rank] += math.prod(p.lengths) * esizes[fqn]
        total = sum(u[4] for u in pending)
        quota = {r: n * total // max(1, sum(need)) for r, n in enumerate(need)}
        owners = assign_owners([(u[4], [p.rank for p in u[5]]) for u in pending], quota)
        units = [_SharedUnit(fqn, chunk, offs, lens, nbytes, owner, parts)
                 for (fqn, chunk, offs, lens, nbytes, parts), owner in zip(pending, owners)]
        # A round holds, per rank, at most the boxes it reads (a temporary),
        # the parts it sends (packed) and those it receives (when they cannot
        # land in their targets), within 1 / (_READ_AHEAD + 2) of the budget:
        # the round being exchanged, the one before it (still on the wire, or
        # being pulled from) and the _READ_AHEAD rounds being read.
        rounds, start = [], 0
        held = [0] * len(plans)
        for i, u in enumerate(units):
            add = [0] * len(plans)
            add[u.owner] += u.nbytes
            for p in u.parts:
                if p.rank != u.owner:
                    nbytes = math.prod(p.lengths) * esizes[u.fqn]
                    add[p.rank] += nbytes
                    add[u.owner] += nbytes
            if i > start and any(h + a > budget // (_READ_AHEAD + 2) for h, a in zip(held, add)):
                rounds.append((start, i))
                start, held = i, [0] * len(plans)
            held = [h + a for h, a in zip(held, add)]
        rounds.append((start, len(units)))
        return _SharePlan(units, rounds, opts.shared_read_transport)

    def _agreed_share_plan(self, plan: LoadPlan) -> _SharePlan | None:
        """The sharing plan the coordinator put in this rank's plan.  The
        coordinator's decision is the only one: every rank of the load
        receives the same plan through DCP's scatter, so every rank runs the
        same collectives (a rank's own options do not change that)."""
        share = plan.storage_data if isinstance(plan.storage_data, _SharePlan) else None
        if share is None or not self._use_collectives:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return share


# --------------------------------------------------------------------------
# jobs: pieces of one engine call, and what to do once they are read


class _Job:
    """Pieces (file, file offset, length, position) read into ``buf`` (the
    target's bytes) or, when ``temp`` > 0, into ``temp`` bytes of the arena;
    then ``post(arena_offset)`` and the ``done`` callbacks."""

    __slots__ = ("files", "offs", "lens", "pos", "buf", "temp", "post", "needed", "done", "temp_off", "units")

    def __init__(self, files, offs, lens, pos, *, buf=None, temp=0, post=None, needed=0, done=None, units=0):
        self.files, self.offs, self.lens, self.pos = files, offs, lens, pos
        self.buf, self.temp, self.post, self.needed = buf, temp, post, needed
        self.units = units  # ranges read whole into the arena
        self.done = [] if done is None else [done]
        self.temp_off = 0

    @classmethod
    def empty(cls, done=None) -> "_Job":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, done=done)

    def add_done(self, fn: Callable[[], None]) -> None:
        self.done.append(fn)


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of the memory from ``t``'s first element to
    its last (``t`` on the CPU, non-negative strides)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset())
    return flat.view(torch.uint8).numpy()


def _direct_jobs(grid: Grid, arrays, buf: np.ndarray, needed: int) -> list[_Job]:
    """Every run straight into the target's bytes (cut at extents and at
    ``_MAX_PIECE_BYTES``), one job per ``_MAX_BATCH_PIECES`` runs."""
    src, dst, _ = unit_starts(grid, len(grid.counts))
    src, dst, lens = split_runs(src, dst, grid.run, _MAX_PIECE_BYTES)
    jobs = []
    step = _MAX_BATCH_PIECES // 2
    for a in range(0, len(src), step):
        s, d, n = src[a : a + step], dst[a : a + step], lens[a : a + step]
        rng, within, files, offs, plen = map_ranges(s, n, *arrays)
        jobs.append(_Job(files, offs, plen, d[rng] + within, buf=buf, needed=int(n.sum())))
    return jobs


def _unit_spans(grid: Grid, level: int, cnt: np.ndarray) -> np.ndarray:
    if level == len(grid.counts):
        return np.full(len(cnt), grid.run, dtype=np.int64)
    inner = level_span(grid, level + 1)
    return (cnt - 1) * grid.src_strides[level] + inner


def _slab_level(grid: Grid, level: int, cap: int) -> tuple[int, int | None]:
    """A level at or inside ``level`` whose sub-grids can be cut along their
    outer dimension into slabs of at most ``cap`` bytes; the slab length."""
    g = len(grid.counts)
    while level < g:
        inner = level_span(grid, level + 1)
        if inner <= cap:
            stride = grid.src_strides[level]
            return level, max(1, (cap - inner) // stride + 1)
        level += 1
    return g, None


def _unit_jobs(grid: Grid, level: int, arrays, run: "_Run", needed: int, copier) -> list[_Job]:
    """Sub-grids over dimensions ``level..`` read as whole ranges into the
    arena (aligned, so large ones are read without a bounce copy), then moved
    by ``copier(arena_offset, unit_offsets, dst_starts, counts)``."""
    a = run.alignment
    level, slab = _slab_level(grid, level, run.cap)
    src, dst, cnt = unit_starts(grid, level, slab)
    spans = _unit_spans(grid, level, cnt)
    runs_per_index = math.prod(grid.counts[level + 1 :]) if level < len(grid.counts) else 1
    rng, within, files, offs, lens = map_ranges(src, spans, *arrays)
    # a unit that is one piece of one file is widened to aligned bounds
    # (clamped to the file's end) so the engine can read it in place
    one = np.bincount(rng, minlength=len(src)) == 1
    head = np.zeros(len(src), dtype=np.int64)
    wide = np.array(spans, dtype=np.int64)
    single = one[rng]
    p_head = np.where(single, offs % a, 0)
    p_end = np.where(single, np.minimum(-(-(offs + lens) // a) * a, run.file_sizes[files]), offs + lens)
    head[rng[single]] = p_head[single]
    wide[rng[single]] = (p_end - (offs - p_head))[single]
    sizes = -(-wide // a) * a
    unit_off = np.cumsum(sizes) - sizes
    jobs = []
    start = 0
    n = len(src)
    piece_start = np.searchsorted(rng, np.arange(n + 1), side="left")
    while start < n:
        # as many units as fit in one cap of arena
        end = int(np.searchsorted(unit_off + sizes, unit_off[start] + run.cap, side="right"))
        end = max(end, start + 1)
        p0, p1 = piece_start[start], piece_start[end]
        base = int(unit_off[start])
        r = rng[p0:p1]
        pos = unit_off[r] - base + np.where(single[p0:p1], 0, head[r] + within[p0:p1])
        j_offs = offs[p0:p1] - p_head[p0:p1]
        j_lens = p_end[p0:p1] - j_offs
        u_off = unit_off[start:end] - base + head[start:end]
        d, c = dst[start:end], cnt[start:end]
        job_needed = int(c.sum()) * runs_per_index * grid.run
        post = (lambda arena, arena_off, u_off=u_off, d=d, c=c: copier(arena, arena_off, u_off, d, c))
        jobs.append(_Job(files[p0:p1], j_offs, j_lens, pos, temp=int(unit_off[end - 1] + sizes[end - 1]) - base,
                         post=post, needed=job_needed, units=end - start))
        start = end
    return jobs


def _unit_shape(grid: Grid, level: int, count: int, esize: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shape and source / destination strides (units of ``esize`` bytes) of a
    sub-grid over ``level..`` with ``count`` indices of its outer dimension."""
    g = len(grid.counts)
    shape = tuple([count] + list(grid.counts[level + 1 :])) if level < g else ()
    ss = tuple(s // esize for s in grid.src_strides[level:]) if level < g else ()
    ds = tuple(s // esize for s in grid.dst_strides[level:]) if level < g else ()
    return shape + (grid.run // esize,), ss + (1,), ds + (1,)


def _numpy_copier(buf: np.ndarray, grid: Grid, level: int, esize: int):
    """Strided copies from the arena into the target's bytes, whole elements
    at a time (a transposed target has one-element runs)."""
    kind = np.dtype(f"u{esize}") if esize in (1, 2, 4, 8) else np.dtype(f"V{esize}")
    strides = _unit_shape(grid, level, 1, esize)

    def copy(arena: np.ndarray, arena_off: int, u_off, dst, cnt) -> None:
        for o, d, c in zip(u_off.tolist(), dst.tolist(), cnt.tolist()):
            shape = (c,) + strides[0][1:] if level < len(grid.counts) else strides[0]
            ss = tuple(x * esize for x in strides[1])
            ds = tuple(x * esize for x in strides[2])
            src = np.ndarray(shape, kind, arena, arena_off + o, ss)
            np.copyto(np.ndarray(shape, kind, buf, d, ds), src)

    return copy


def _torch_copier(dest: torch.Tensor, dtype: torch.dtype, grid: Grid, level: int, run: "_Run"):
    """Strided copies from the arena (stored dtype) into ``dest`` (any dtype or
    device): ``copy_`` casts as the stock reader does."""
    esize = dtype.itemsize

    def copy(arena: np.ndarray, arena_off: int, u_off, dst, cnt) -> None:
        typed = run.arena_typed(dtype)
        for o, d, c in zip(u_off.tolist(), dst.tolist(), cnt.tolist()):
            shape, ss, ds = _unit_shape(grid, level, c, esize)
            src = typed.as_strided(shape, ss, (arena_off + o) // esize)
            dest.as_strided(shape, ds, dest.storage_offset() + d // esize).copy_(src)

    return copy


def _packed_temp_jobs(grid: Grid, arrays, needed: int, target: torch.Tensor, dtype: torch.dtype, run: "_Run") -> list[_Job]:
    """Runs into a packed temporary of the stored dtype, then ``target.copy_``."""
    src, dst, _ = unit_starts(grid, len(grid.counts))
    rng, within, files, offs, lens = map_ranges(src, np.full(len(src), grid.run, dtype=np.int64), *arrays)
    esize = dtype.itemsize
    shape = tuple(target.shape)

    def post(arena: np.ndarray, arena_off: int) -> None:
        t = run.arena_typed(dtype).narrow(0, arena_off // esize, needed // esize).view(shape)
        target.copy_(t)

    a = run.alignment
    return [_Job(files, offs, lens, dst[rng] + within, temp=-(-needed // a) * a, post=post, needed=needed, units=1)]


# --------------------------------------------------------------------------
# execution


class _Run:
    """The state of one load on one rank: open files, the arena, the stats."""

    def __init__(self, reader: FastPersistReader, session: IOSession, paths: list[str]) -> None:
        self.reader = reader
        self.session = session
        self.paths = paths
        self.alignment = session.alignment
        opts = reader.options
        self.budget = opts.read_buffer_budget_bytes
        self.cap = max(self.alignment, self.budget // 4)
        assert reader.layout is not None
        self.file_sizes = np.array([size for _, size in reader.layout.files] or [0], dtype=np.int64)
        self.verifier = reader._checksums(paths)
        self.large = reader._large_engine()
        self.fds: dict[int, int] = {}
        self.arena: Any = None
        self.arena_np: np.ndarray | None = None
        self.arena_t: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.scratch = np.empty(max(2 * self.alignment, opts.coalesce_gap_bytes), dtype=np.uint8)
        self.stats: dict[str, Any] = {
            "engine": session.kind,
            "bytes": 0,
            "bytes_read": 0,
            "requests": 0,
            "pieces": 0,
            "fillers": 0,
            "filler_bytes_paid": 0,
            "engine_calls": 0,
            "temp_bytes": 0,
            "temp_units": 0,
            "checksum_verified_bytes": 0,
            "checksum_bytes": 0,  # bytes the engine fed to the CRC (each read byte at most once)
            "large_request_bytes": 0,  # bytes moved by the engine of large requests (long runs)
            "read_seconds": 0.0,
            "copy_seconds": 0.0,
        }
        self.total = 0
        self.done_bytes = 0
        self.paid_left = 0
        self.planned_paid = 0  # over-read the item plans chose (merged sub-grids), not yet charged

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        self._typed = {}
        self.arena_t = None
        self.arena_np = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def arena_typed(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed.get(dtype)
        if t is None:
            assert self.arena_t is not None
            t = self._typed[dtype] = self.arena_t.view(dtype)
        return t

    def _ensure_arena(self, size: int) -> None:
        if self.arena is not None and self.arena.size >= size:
            return
        self._typed = {}
        self.arena_t = None
        self.arena_np = None
        if self.arena is not None:
            self.arena.close()
        size = -(-size // (1 << 20)) * (1 << 20)  # whole MiB: every dtype views it
        self.arena = _native.AlignedBuffer(size, max(self.alignment, 4096), lock=False)
        self.arena_np = np.frombuffer(self.arena, dtype=np.uint8)
        self.arena_t = torch.frombuffer(self.arena, dtype=torch.uint8)
        self.stats["temp_bytes"] = size

    def _engine_read(self, session: IOSession, files, offs, views, check) -> None:
        kwargs = check.engine_kwargs if check is not None else {}
        used, local = np.unique(files, return_inverse=True)
        fds = [self._fd(int(f)) for f in used.tolist()]
        s = session.engine.read(
            fds, [self.paths[int(f)] for f in used.tolist()], local.astype(np.int64), offs, views,
            coalesce_gap=0, **kwargs
        )
        if check is not None:
            self.stats["checksum_verified_bytes"] += check.verify(s)
            self.stats["checksum_bytes"] += s.get("checksum_bytes", 0)
        self.stats["bytes_read"] += s.get("bytes_read", 0)
        self.stats["requests"] += s.get("requests", 0)
        if session is self.large:
            self.stats["large_request_bytes"] += s.get("bytes", 0)
        self.stats["engine_calls"] += 1

    def _fd(self, file: int) -> int:
        fd = self.fds.get(file)
        if fd is None:
            fd = self.fds[file] = self.session.engine.open(self.paths[file], "r", self.session.direct or False)
        return fd

    def execute(self, jobs: list[_Job]) -> None:
        needed = sum(j.needed for j in jobs)
        self.total += needed
        self.stats["bytes"] += needed
        self.paid_left += needed * self.reader.options.max_overread_percent // 100 - self.planned_paid
        self.stats["merged_bytes_paid"] = self.stats.get("merged_bytes_paid", 0) + self.planned_paid
        self.planned_paid = 0
        temp_total = sum(j.temp for j in jobs)
        if temp_total:
            self._ensure_arena(min(self.budget, temp_total))
        max_bytes = _PROGRESS_BATCH_BYTES if self.reader.progress else _MAX_BATCH_BYTES
        batch: list[_Job] = []
        used = pieces = nbytes = 0
        for job in jobs:
            if batch and (used + job.temp > self.budget or pieces + len(job.offs) > _MAX_BATCH_PIECES
                          or nbytes + job.needed > max_bytes):
                self._flush(batch)
                batch, used, pieces, nbytes = [], 0, 0, 0
            job.temp_off = used
            used += job.temp
            pieces += len(job.offs)
            nbytes += job.needed
            batch.append(job)
        self._flush(batch)

    def _flush(self, batch: list[_Job]) -> None:
        if not batch:
            return
        files = np.concatenate([j.files for j in batch])
        offs = np.concatenate([j.offs for j in batch])
        lens = np.concatenate([j.lens for j in batch])
        if len(offs):
            keep = lens > 0
            views: list[memoryview] = []
            arena_mv = memoryview(self.arena) if self.arena is not None else None
            for j in batch:
                if j.temp:
                    base = arena_mv[j.temp_off : j.temp_off + j.temp]
                else:
                    base = memoryview(j.buf)
                views.extend(base[p : p + n] for p, n in zip(j.pos.tolist(), j.lens.tolist()))
            if not keep.all():
                idx = np.flatnonzero(keep)
                files, offs, lens = files[idx], offs[idx], lens[idx]
                views = [views[i] for i in idx.tolist()]
            order = np.lexsort((offs, files))
            files, offs, lens = files[order], offs[order], lens[order]
            views = [views[i] for i in order.tolist()]
            ffiles, foffs, flens, paid = plan_fillers(
                files, offs, lens, self.alignment, self.paid_left, self.reader.options.coalesce_gap_bytes
            )
            self.paid_left -= paid
            self.stats["filler_bytes_paid"] += paid
            self.stats["fillers"] += len(foffs)
            self.stats["pieces"] += len(offs)
            if len(foffs):
                scratch = memoryview(self.scratch)
                views.extend(scratch[:n] for n in flens.tolist())
                files = np.concatenate([files, ffiles])
                offs = np.concatenate([offs, foffs])
                lens = np.concatenate([lens, flens])
                order = np.lexsort((offs, files))
                files, offs = files[order], offs[order]
                views = [views[i] for i in order.tolist()]
            check = None
            if self.verifier is not None:
                # pieces cut at extent boundaries; every checksum block a piece
                # covers whole is compared with the CRC stored at save time
                files, offs, views, check = self.verifier.plan(files, offs, views, skip=self.scratch)
            t0 = time.perf_counter()
            large = self.large
            if large is None:
                self._engine_read(self.session, files, offs, views, check)
            else:
                # long runs as large requests, the rest (scattered small runs) as
                # small ones; a run is a stretch of pieces back to back in one
                # file (packed small tensors, pieces joined by fillers)
                long = _in_long_runs(files, offs, np.fromiter((v.nbytes for v in views), dtype=np.int64,
                                                              count=len(views)))
                for session, mask in ((large, long), (self.session, ~long)):
                    if mask.all():
                        self._engine_read(session, files, offs, views, check)
                    elif mask.any():
                        idx = np.flatnonzero(mask)
                        self._engine_read(session, files[idx], offs[idx], [views[i] for i in idx.tolist()],
                                          None if check is None else check.subset(idx))
            self.stats["read_seconds"] += time.perf_counter() - t0
            del views
        t0 = time.perf_counter()
        for j in batch:
            self.stats["temp_units"] += j.units
            if j.post is not None:
                j.post(self.arena_np, j.temp_off)
            for fn in j.done:
                fn()
            self.done_bytes += j.needed
        self.stats["copy_seconds"] += time.perf_counter() - t0
        if self.reader.progress is not None:
            self.reader.progress(self.done_bytes, self.total)


# --------------------------------------------------------------------------
# replicated reads shared over the process group


def _in_long_runs(files: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For pieces sorted by (file, offset): whether each lies in a run of at
    least ``_LONG_RUN_BYTES`` of pieces back to back (or overlapping) in one
    file, the requests of which the engine of large requests makes."""
    n = len(lens)
    if n == 0:
        return np.zeros(0, dtype=bool)
    shift = int(max(int((offs + lens).max()), 1)).bit_length() + 1
    keys = (files.astype(np.int64) << shift) + offs  # files far apart: a run never crosses one
    ends = np.maximum.accumulate(keys + lens)
    new = np.ones(n, dtype=bool)
    new[1:] = keys[1:] > ends[:-1]
    first = np.flatnonzero(new)
    span = np.maximum.reduceat(keys + lens, first) - keys[first]
    return span[np.cumsum(new) - 1] >= _LONG_RUN_BYTES


def _read_key(req: ReadItem) -> tuple:
    idx = req.storage_index
    return (idx.fqn, None if idx.offset is None else tuple(idx.offset),
            tuple(req.storage_offsets), tuple(req.lengths))


def _transfer_device(group: Any) -> torch.device:
    """Where the group's point-to-point buffers must live: CUDA for NCCL, the
    CPU for gloo (also a "cpu:gloo,cuda:nccl" group) and others."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _takes_transfer(view: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """``view`` can be sent or received into as it is."""
    return (view.device == device and view.dtype == dtype and view.is_contiguous()
            and not view.is_conj() and not view.is_neg())


class _Scratch:
    """Reusable memory for one round's temporaries: ``take`` hands out
    tensors back to back (aligned, on ``device``), ``reset`` starts over.
    CPU memory comes from an aligned buffer, so the engine reads into it
    without a bounce copy, and is faulted in once per load."""

    def __init__(self, device: torch.device, alignment: int, prefault: bool = True) -> None:
        self.device, self.alignment, self.prefault = device, max(64, alignment), prefault
        self.raw: Any = None
        self.base: torch.Tensor | None = None
        self.used = 0

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (call before ``take``, after ``reset``)."""
        if nbytes <= self.size:
            return
        size = -(-nbytes // self.alignment) * self.alignment
        if self.device.type == "cpu":
            self.raw = _native.AlignedBuffer(size, max(self.alignment, 4096), lock=False, prefault=self.prefault)
            self.base = torch.frombuffer(self.raw, dtype=torch.uint8)
        else:
            self.base = torch.empty(size, dtype=torch.uint8, device=self.device)

    def reset(self) -> None:
        self.used = 0

    @property
    def size(self) -> int:
        return 0 if self.base is None else self.base.numel()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // self.alignment) * self.alignment
        if self.base is None or start + nbytes > self.base.numel():
            return torch.empty(list(shape), dtype=dtype, device=self.device)  # a plan that under-reserved
        self.used = start + nbytes
        return self.base[start : start + nbytes].view(dtype).view(list(shape))

    def need(self, sizes: list[int]) -> int:
        a = self.alignment
        return sum(-(-n // a) * a for n in sizes)


def _machine_key() -> tuple:
    """Equal for two processes that may be able to read each other's memory:
    the same host name and boot, the same pid namespace."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return (socket.gethostname(), os.getpid())  # unknown: only itself
    return (socket.gethostname(), boot, pidns)


def _machine_id() -> int:
    """:func:`_machine_key` as a signed 64-bit hash."""
    import hashlib

    digest = hashlib.blake2b(repr(_machine_key()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _pull_table(group: Any, rank: int, world: int, progress: int,
                device: torch.device) -> tuple[list[frozenset[int]], list[int], list[int]]:
    """``(table, pids, progress)``: ``table[r]`` the ranks whose memory rank
    ``r`` can copy from with ``process_vm_readv``, ``pids[r]`` rank ``r``'s
    process, ``progress[r]`` the address of its progress counter (this
    rank's is at ``progress``).

    Each rank shows a random token in its memory; every other rank of the
    same machine key pulls it and keeps the peer only when the token came
    back, so a refused call (ptrace rules, seccomp), another pid namespace
    or a reused pid is never trusted.  Two all-gathers of small int64
    tensors (on ``device``, the group's); every rank learns the whole
    table, so both ends of a part agree on how it moves."""
    import torch.distributed as dist

    token = np.frombuffer(secrets.token_bytes(16), dtype=np.int64).copy()
    key = _machine_id()
    mine = torch.tensor([key, os.getpid(), int(token.ctypes.data), int(token[0]), int(token[1]), progress],
                        dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    peers = torch.stack(rows).cpu().numpy()
    reachable = torch.zeros(world, dtype=torch.int64)
    got = np.zeros(2, dtype=np.int64)
    for r in range(world):
        if r == rank or peers[r, 0] != key:
            continue
        got[:] = 0
        try:
            _native.pull(int(peers[r, 1]), got.view(np.uint8), int(peers[r, 2]), _ZERO_START, 16)
        except OSError:
            continue
        if got[0] == peers[r, 3] and got[1] == peers[r, 4]:
            reachable[r] = 1
    table = [torch.empty_like(reachable, device=device) for _ in range(world)]
    dist.all_gather(table, reachable.to(device), group=group)  # also: no rank's token is pulled after this
    seen = torch.stack(table).cpu().numpy()
    return ([frozenset(np.flatnonzero(row).tolist()) for row in seen], peers[:, 1].tolist(), peers[:, 5].tolist())


def _share_reads(reader: FastPersistReader, run: _Run | None, items: list[ReadItem], planner: LoadPlanner,
                 share: _SharePlan, setup_error: BaseException | None = None) -> list[ReadItem]:
    """Read the shared units this rank owns, exchange their parts with the
    ranks that need them, and return the items still to read from disk.

    Every rank runs the same collectives in the same order: per round one
    all-gather of a status (and, when a rank failed, of the errors), so a
    failed read raises on every rank in the same round instead of leaving the
    others waiting; then the point-to-point sends and receives of that
    round's parts.  Round ``i``'s transfers are in flight while rounds
    ``i + 1`` and ``i + 2`` are read from disk (``_READ_AHEAD``); a target is
    committed once all its parts have arrived.

    With the ``"auto"`` transport, a part whose owner is on the same machine
    (:func:`_pull_table`) is pulled: the status all-gather also carries the
    address of every box the owners read this round, and the rank that needs
    the part copies it from there with one ``process_vm_readv`` into its
    target.  The owner keeps that box untouched until the ranks that pull
    from it have: each keeps a counter of the rounds it has pulled, which
    the owner reads (8 bytes, the same way) before it reads another round
    into that box; one status more ends the load, so no rank frees a box
    before every rank has pulled from it.
    """
    import torch.distributed as dist

    group = reader.process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    device = _transfer_device(group)
    can_pull: list[frozenset[int]] = [frozenset()] * world
    pids: list[int] = []
    progress_at: list[int] = []
    # the rounds this rank has pulled its parts of: owners read it (a pull
    # of 8 bytes) before they reuse the box of a round for another round
    progress = np.zeros(1, dtype=np.int64)
    if share.transport == "auto" and world > 1:
        can_pull, pids, progress_at = _pull_table(group, rank, world, int(progress.ctypes.data), device)

    def pulled(u: _SharedUnit, p: _Part) -> bool:
        return p.rank != u.owner and u.owner in can_pull[p.rank]

    # Per round: per owner, its units with a pulled part (their addresses go
    # out with the round's status, in this order); the bytes of the boxes
    # this rank reads, and of its parts it packs to send.
    pull_units: list[list[list[int]]] = []
    owned: list[tuple[list[int], list[int]]] = []
    pullers: list[set[int]] = []  # per round, the ranks that pull from this rank's boxes
    for r0, r1 in share.rounds:
        per: list[list[int]] = [[] for _ in range(world)]
        boxes, packed = [], []
        pullers.append(set())
        for ui in range(r0, r1):
            u = share.units[ui]
            if any(pulled(u, p) for p in u.parts):
                per[u.owner].append(ui)
            if u.owner == rank:
                pullers[-1].update(p.rank for p in u.parts if pulled(u, p))
                esize = u.nbytes // max(1, math.prod(u.lengths))
                boxes.append(u.nbytes)
                packed += [math.prod(p.lengths) * esize for p in u.parts if p.rank != rank and not pulled(u, p)]
        pull_units.append(per)
        owned.append((boxes, packed))
    pulling = any(any(per) for per in pull_units)
    by_key: dict[tuple, list[ReadItem]] = {}
    for req in items:
        if req.type == LoadItemType.TENSOR:
            by_key.setdefault(_read_key(req), []).append(req)
    # the parts each of this rank's items waits for, and one tag per part
    left: dict[tuple, int] = {}
    tag_base: list[int] = []
    ntags = 0
    for u in share.units:
        tag_base.append(ntags)
        ntags += len(u.parts)
        for p in u.parts:
            if p.rank == rank:
                key = u.item_key(p)
                left[key] = left.get(key, 0) + 1
    dests: dict[int, torch.Tensor] = {}
    alignment = run.alignment if run is not None else 4096
    # The _READ_AHEAD rounds read ahead are read at once, each by its own
    # engine (round i by runs[i % len(runs)]), so the disk is not idle while
    # one engine call drains its last requests (rounds are a few MiB a rank).
    # A second engine is only faster: when it cannot be had (locked memory,
    # the kernel's AIO limit) one engine reads every round.
    runs: list[_Run] = [] if run is None else [run]
    if run is not None and setup_error is None:
        while len(runs) < min(_READ_AHEAD, len(share.rounds)):
            try:
                runs.append(_Run(reader, reader._twin(len(runs) - 1), run.paths))
            except (OSError, MemoryError, RuntimeError):
                break
    # Round i's buffers are reused by round i + len(...): see the loop below.
    # A box others pull from is reused once they have pulled it: when this
    # rank can read their progress counters, as soon as they show it; else
    # once every rank has passed the next round's status (one box more).
    counted = all(r in can_pull[rank] for ranks in pullers for r in ranks)
    temps = [_Scratch(torch.device("cpu"), alignment) for _ in range(_READ_AHEAD + (1 if counted else 2))]
    packs = [_Scratch(device, alignment) for _ in range(_READ_AHEAD + 1)]
    # used only for targets that cannot take a receive / a pull as they are
    recvs = [_Scratch(device, alignment, prefault=False) for _ in range(_READ_AHEAD + 1)]
    landings = [_Scratch(torch.device("cpu"), alignment, prefault=False) for _ in range(_READ_AHEAD + 1)]

    # each temporary and pack is allocated (and faulted in) once, for the
    # largest round, not again whenever a round is larger than the last
    peak_temp = max((temps[0].need(b) for b, _ in owned), default=0)
    peak_pack = max((packs[0].need(k) for _, k in owned), default=0)
    # the disk reads of a round (a background thread) see only its jobs and
    # its ``_Run``; nothing else touches that meanwhile
    stats = {"shared_bytes_sent": 0, "shared_bytes_received": 0, "shared_bytes_read": 0,
             "shared_bytes_pulled": 0, "shared_rounds": len(share.rounds), "shared_wait_seconds": 0.0,
             "shared_pull_seconds": 0.0}
    read_needed = my_bytes = 0
    pull_error: list[BaseException] = []  # a failed pull, raised on every rank at the next status

    def dest_of(req: ReadItem, dtype: torch.dtype) -> torch.Tensor:
        d = dests.get(id(req))
        if d is None:
            d = dests[id(req)] = reader._target(req, planner, dtype)
        return d

    def views(u: _SharedUnit, p: _Part, dtype: torch.dtype) -> list[tuple[ReadItem, torch.Tensor]]:
        """This rank's targets of part ``p``: (read item, view of its target)."""
        reqs = by_key.get(u.item_key(p))
        if not reqs:
            raise RuntimeError(f"{u.fqn}: the shared-read plan names a read this rank does not have "
                               f"(box {list(p.item_offsets)}+{list(p.item_lengths)})")
        rel = tuple(slice(o - io, o - io + n) for o, io, n in zip(p.offsets, p.item_offsets, p.lengths))
        return [(req, dest_of(req, dtype)[rel]) for req in reqs]

    def arrived(key: tuple) -> None:
        left[key] -= 1
        if left[key] == 0:
            for req in by_key[key]:
                planner.commit_tensor(req, dests[id(req)])

    class _Round:
        """One round on this rank: what it reads, sends, receives, finishes."""

        def __init__(self, index: int) -> None:
            self.index = index
            self.error: BaseException | None = None
            self.jobs: list[_Job] = []
            self.reads: list[tuple[int, _SharedUnit, torch.Tensor, torch.dtype]] = []
            self.sends: list[tuple[torch.Tensor, int, int]] = []
            self.receives: list[tuple[torch.Tensor, int, int]] = []
            self.finishes: list[Callable[[], None]] = []
            self.pulls: list[tuple[int, _SharedUnit, _Part, torch.Tensor, Callable[[], None]]] = []
            self.addresses: dict[int, int] = {}  # unit -> address of the box this rank read
            self.works: list[Any] = []
            self.read_needed = 0
            self.my_bytes = 0

    def prepare(ri: int) -> _Round:
        """Resolve the round's targets, choose its buffers, plan its reads
        (main thread; errors are kept for the round's agreement)."""
        rd = _Round(ri)
        try:
            if setup_error is not None:
                raise setup_error
            run = runs[ri % len(runs)]
            r0, r1 = share.rounds[ri]
            k = ri % len(packs)  # as recvs and landings
            temp, pack, recv, landing = temps[ri % len(temps)], packs[k], recvs[k], landings[k]
            if counted and ri >= len(temps):
                wait_pulled(ri - len(temps))  # the round whose box ``temp`` holds
            for sc in (temp, pack):
                fut = faulting.pop(id(sc), None)
                if fut is not None:  # allocated ahead by the prefault thread
                    fut.result()
            for sc in (temp, pack, recv, landing):
                sc.reset()
            if owned[ri][0]:
                temp.reserve(peak_temp)
            if owned[ri][1]:
                pack.reserve(peak_pack)
            # this rank's parts of others' boxes: (unit index, unit, part index,
            # part, dtype, its target views, the view that takes it as it is)
            incoming = []
            for ui in range(r0, r1):
                u = share.units[ui]
                chunk = None if u.chunk is None else list(u.chunk)
                sizes, dtype = reader._chunk_sizes(u.fqn, chunk)
                if u.owner == rank:
                    src = None
                    for p in u.parts:  # a target that is the whole box takes the read itself
                        if p.rank == rank and p.offsets == u.offsets and p.lengths == u.lengths:
                            src = next((v for _, v in views(u, p, dtype)
                                        if _takes_transfer(v, dtype, torch.device("cpu"))), None)
                            if src is not None:
                                break
                    if src is None:
                        src = temp.take(u.lengths, dtype)
                    rd.jobs.extend(reader._plan_box(u.fqn, chunk, sizes, dtype, list(u.offsets), list(u.lengths),
                                                    src, run, lambda: None))
                    rd.reads.append((ui, u, src, dtype))
                    rd.addresses[ui] = src.data_ptr()  # contiguous, the box's shape
                    continue
                for pi, p in enumerate(u.parts):
                    if p.rank == rank:
                        vs = views(u, p, dtype)
                        on = torch.device("cpu") if pulled(u, p) else device
                        incoming.append((ui, u, pi, p, dtype, vs,
                                         next((v for _, v in vs if _takes_transfer(v, dtype, on)), None)))
            for sc, by_pull in ((recv, False), (landing, True)):
                sc.reserve(sc.need([math.prod(p.lengths) * dtype.itemsize
                                    for _, u, _, p, dtype, _, buf in incoming
                                    if buf is None and pulled(u, p) == by_pull]))
            for ui, u, pi, p, dtype, vs, buf in incoming:
                if buf is None:
                    buf = (landing if pulled(u, p) else recv).take(p.lengths, dtype)
                rd.my_bytes += buf.numel() * buf.element_size()

                def finish(vs=vs, buf=buf, key=u.item_key(p)) -> None:
                    for _, v in vs:
                        if v is not buf:
                            v.copy_(buf)
                    arrived(key)

                if pulled(u, p):
                    rd.pulls.append((ui, u, p, buf, finish))
                else:
                    rd.receives.append((buf, u.owner, tag_base[ui] + pi))
                    rd.finishes.append(finish)
        except BaseException as e:  # noqa: BLE001 - agreed on below
            rd.error = e
        return rd

    def read(rd: _Round) -> None:
        """The round's disk reads (the background thread)."""
        if rd.error is not None or not rd.jobs:
            return
        run = runs[rd.index % len(runs)]
        before = run.stats["bytes"]
        run.execute(rd.jobs)
        rd.read_needed = run.stats["bytes"] - before

    def split(rd: _Round) -> None:
        """Owner: copy its own parts into its targets, pack the others'."""
        if rd.error is not None:
            return
        pack = packs[rd.index % len(packs)]
        try:
            for ui, u, src, dtype in rd.reads:
                stats["shared_bytes_read"] += u.nbytes
                for pi, p in enumerate(u.parts):
                    rel = tuple(slice(o - uo, o - uo + n) for o, uo, n in zip(p.offsets, u.offsets, p.lengths))
                    part = src[rel]
                    if p.rank == rank:
                        for _, v in views(u, p, dtype):
                            if v.data_ptr() != part.data_ptr() or v.stride() != part.stride():
                                v.copy_(part)
                        rd.finishes.append(lambda key=u.item_key(p): arrived(key))
                        rd.my_bytes += part.numel() * part.element_size()
                    elif pulled(u, p):  # the rank copies it from ``src`` itself
                        stats["shared_bytes_sent"] += part.numel() * part.element_size()
                    elif _takes_transfer(part, dtype, device):
                        # a target, or this round's temporary: neither is
                        # written again before the send has completed
                        rd.sends.append((part, p.rank, tag_base[ui] + pi))
                    else:
                        buf = pack.take(p.lengths, dtype)
                        buf.copy_(part)
                        rd.sends.append((buf, p.rank, tag_base[ui] + pi))
        except BaseException as e:  # noqa: BLE001
            rd.error = e

    def agree(rd: _Round) -> dict[int, int]:
        """Every rank learns whether any rank failed this round; all raise.
        Returns the addresses of the boxes read this round that have pulled
        parts (unit -> address in its owner)."""
        if pull_error and rd.error is None:
            rd.error = pull_error[0]
        error = None if rd.error is None else f"{type(rd.error).__name__}: {rd.error}"
        per = pull_units[rd.index] if rd.index < len(pull_units) else [[] for _ in range(world)]
        width = 1 + max(len(x) for x in per)
        status = torch.zeros(width, dtype=torch.int64)
        status[0] = 0 if error is None else 1
        if error is None:
            for j, ui in enumerate(per[rank]):
                status[1 + j] = rd.addresses[ui]
        status = status.to(device)
        statuses = [torch.empty_like(status) for _ in range(world)]
        dist.all_gather(statuses, status, group=group)
        gathered = torch.stack(statuses).cpu()
        if gathered[:, 0].any():
            errors: list[Any] = [None] * world
            dist.all_gather_object(errors, error, group=group)
            failed = {r: e for r, e in enumerate(errors) if e is not None}
            first = min(failed)
            raise RuntimeError(
                f"shared read failed on rank {first}: {failed[first]}"
                + ("" if first == rank else " (this rank stopped because of it)")
            )
        return {ui: int(gathered[r, 1 + j]) for r in range(world) for j, ui in enumerate(per[r])}

    def pull_failed(what: str, owner: int, e: BaseException) -> RuntimeError:
        return RuntimeError(f"{what} from rank {owner}'s memory (pid {pids[owner]}) failed: {e}; set "
                            "shared_read_transport='process_group' to send parts instead")

    def wait_pulled(ri: int) -> None:
        """Until every rank that pulls parts of this rank's boxes of round
        ``ri`` has pulled them: its progress counter is past ``ri``.  They
        pull right after that round's status, which this rank has passed,
        so this waits for nothing this rank still has to do."""
        cell = np.zeros(1, dtype=np.int64)
        for r in sorted(pullers[ri]):
            while True:
                try:
                    _native.pull(pids[r], cell.view(np.uint8), progress_at[r], _ZERO_START, 8)
                except OSError as e:
                    raise pull_failed("reading the progress counter", r, e) from e
                if cell[0] > ri:
                    break
                time.sleep(0.0002)

    def pull(rd: _Round, addresses: dict[int, int]) -> None:
        """Copy this rank's pulled parts of the round out of their owners'
        memory and finish them; a failure is raised at the next status."""
        if pull_error or not rd.pulls:
            return
        t = time.perf_counter()
        try:
            for ui, u, p, buf, finish in rd.pulls:
                esize = buf.element_size()
                rel = [o - uo for o, uo in zip(p.offsets, u.offsets)]
                starts, run_length = box_runs(u.lengths, rel, p.lengths, esize)
                _native.pull(pids[u.owner], _storage_bytes(buf), addresses[ui], starts, run_length)
                stats["shared_bytes_pulled"] += buf.numel() * esize
                stats["shared_bytes_received"] += buf.numel() * esize
                finish()
        except BaseException as e:  # noqa: BLE001 - agreed on at the next status
            pull_error.append(pull_failed(f"{u.fqn}: copying a shared part", u.owner, e))
        stats["shared_pull_seconds"] += time.perf_counter() - t

    def post(rd: _Round) -> None:
        for buf, _, _ in rd.sends:
            stats["shared_bytes_sent"] += buf.numel() * buf.element_size()
        for buf, _, _ in rd.receives:
            stats["shared_bytes_received"] += buf.numel() * buf.element_size()
        if device.type == "cuda":
            # NCCL runs a pair's sends and receives in order on one stream: a
            # send waits for its receive, so two ranks that both send first
            # would wait on each other.  One group call posts them together.
            ops = [dist.P2POp(dist.isend, buf, group=group, group_peer=dst, tag=tag % (1 << 30))
                   for buf, dst, tag in rd.sends]
            ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=src, tag=tag % (1 << 30))
                    for buf, src, tag in rd.receives]
            if ops:
                rd.works.extend(dist.batch_isend_irecv(ops))
            return
        for buf, dst, tag in rd.sends:
            rd.works.append(dist.isend(buf, group=group, group_dst=dst, tag=tag % (1 << 30)))
        for buf, src_rank, tag in rd.receives:
            rd.works.append(dist.irecv(buf, group=group, group_src=src_rank, tag=tag % (1 << 30)))

    def complete(rd: _Round) -> None:
        t = time.perf_counter()
        for w in rd.works:
            w.wait()
        stats["shared_wait_seconds"] += time.perf_counter() - t
        for fn in rd.finishes:
            fn()

    # Rounds i + 1 .. i + _READ_AHEAD are read from disk by helper threads
    # (the engines release the GIL; one engine each, see ``runs``) while this
    # thread splits round i, posts its transfers and pulls its parts, and
    # gloo's threads move round i - 1.
    # Round i + _READ_AHEAD is prepared once round i - 1 has completed, so
    # sends, receives, packs and temporaries cycle through _READ_AHEAD + 1
    # buffers; a box others pull from is reused once they have pulled it
    # (``wait_pulled``; one temporary more where the counters cannot be read).
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    n = len(share.rounds)
    pending: _Round | None = None  # posted, not completed
    reading: deque = deque()  # (round, future), in order
    # Memory a process touches for the first time is slow to fault in (on
    # some VMs, whose host hands out a page only when the guest first writes
    # it, about 0.4 GB/s for huge pages: 40 ms for one 16 MiB temporary).
    # The temporaries and packs are faulted in by a thread of their own, in
    # the order the rounds take them, while the first rounds are read, not
    # by this thread when a round needs one (which stalled the rounds here).
    faulting: dict[int, Any] = {}
    prefault = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp_dcp-prefault")
    if setup_error is None:
        for ri in range(n):
            for sc, nbytes in ((temps[ri % len(temps)], peak_temp if owned[ri][0] else 0),
                               (packs[ri % len(packs)], peak_pack if owned[ri][1] else 0)):
                if nbytes and id(sc) not in faulting:
                    faulting[id(sc)] = prefault.submit(sc.reserve, nbytes)
    with prefault, ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="fp_dcp-shared-read") as pool:
        try:
            for ri in range(min(n, _READ_AHEAD)):
                rd = prepare(ri)
                reading.append((rd, pool.submit(read, rd)))
            for ri in range(n):
                rd, fut = reading.popleft()
                try:
                    fut.result()
                except BaseException as e:  # noqa: BLE001
                    rd.error = rd.error or e
                if pending is not None:  # frees the buffers round ri + _READ_AHEAD takes
                    done, pending = pending, None
                    complete(done)
                if ri + _READ_AHEAD < n:
                    nxt = prepare(ri + _READ_AHEAD)
                    reading.append((nxt, pool.submit(read, nxt)))
                split(rd)
                addresses = agree(rd)
                read_needed += rd.read_needed
                my_bytes += rd.my_bytes
                post(rd)
                pull(rd, addresses)
                progress[0] = rd.index + 1  # its owners may reuse the round's boxes
                pending = rd
            if pulling:  # no rank frees a box before every rank has pulled from it
                agree(_Round(n))
        finally:
            progress[0] = n + 1  # pulls no more (also when it leaves early): no owner waits for it
            for fut in faulting.values():  # not started: not needed any more
                fut.cancel()
            for _, fut in reading:  # a failed round: let the next reads end before their buffers go
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001
                    pass
            if pending is not None:  # matched on every rank: completes also when a later round failed
                complete(pending)
            for extra in runs[1:]:
                extra.close()  # its session stays with the reader, as the first
    assert run is not None
    for extra in runs[1:]:
        for k, v in extra.stats.items():
            if isinstance(v, (int, float)):  # some keys appear only once a run has read
                run.stats[k] = run.stats.get(k, 0) + v
    stats["shared_buffer_bytes"] = sum(sc.size for sc in temps + packs + recvs + landings)
    run.stats.update(stats)
    # "bytes" counts what this rank's targets need, not the boxes it read for others
    run.stats["bytes"] += my_bytes - read_needed
    covered = set(left)
    return [r for r in items if _read_key(r) not in covered]
