"""``FastPersistWriter``: a DCP ``StorageWriter`` that writes at the disk's speed.

Call sequence (``torch.distributed.checkpoint.state_dict_saver``):

1. every rank: ``reset`` / ``set_up_storage_writer`` / ``prepare_local_plan``
   — records what this rank holds in ``SavePlan.storage_data``;
2. coordinator: ``prepare_global_plan`` — names this save (``save_id``) and
   tells every rank which data files are its own;
3. every rank: ``write_data`` — lays its items out in its files (large
   extents aligned, small ones packed) and streams them through the native
   engine (O_DIRECT, queue of aligned requests, zero-copy where the source is
   aligned, page-locked double buffers for CUDA tensors);
4. coordinator: ``finish`` — writes the metadata through a temporary name and
   a rename (the commit), syncs the directory, then removes the data files of
   the checkpoint it superseded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import io
import os
import secrets
import socket
import time
from torch.futures import Future
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

import fp_dcp
from fp_dcp import format as fmt
from fp_dcp.engine import IOSession, PinnedBuffer, tensor_bytes
from fp_dcp.layout import align_up, place_extents
from fp_dcp.options import FastPersistOptions
from fp_dcp.staging import AsyncStagingMixin

__all__ = ["FastPersistWriter"]

_LOCK_NAME = ".fp_dcp.lock"


@dataclasses.dataclass(frozen=True)
class _LocalInfo:
    """What ``prepare_local_plan`` records for the coordinator."""

    rank: int
    host: str


@dataclasses.dataclass(frozen=True)
class _Assignment:
    """What ``prepare_global_plan`` hands each rank."""

    save_id: str
    rank: int


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: where an item's bytes went.

    ``extents`` holds ``(file_name, file_offset, item_offset, length)``;
    ``file_sizes`` is set on one result per file: its size on disk."""

    extents: tuple[tuple[str, int, int, int], ...]
    file_sizes: tuple[tuple[str, int], ...] = ()


def _item_name(item: WriteItem) -> str:
    if item.index.offset is not None and item.type == WriteItemType.SHARD:
        return f"{item.index.fqn} (shard at {list(item.index.offset)})"
    return item.index.fqn


def _expected_nbytes(item: WriteItem) -> int | None:
    td = item.tensor_data
    if td is None:
        return None
    return int(np.prod(td.chunk.sizes, dtype=np.int64)) * torch.empty((), dtype=td.properties.dtype).element_size()


class FastPersistWriter(AsyncStagingMixin, StorageWriter):
    """Write a DCP checkpoint into the directory ``path``.

    ``options`` is a :class:`~fp_dcp.FastPersistOptions`; keyword arguments
    are shorthand for its fields (``FastPersistWriter(path, engine="uring")``).
    One writer serves a series of saves: DCP calls :meth:`reset` with a new
    ``checkpoint_id`` (a directory) before each; the engine and its buffers
    are kept between saves.  Call :meth:`close` (or use ``with``) to release
    them at once.

    After each save, :attr:`last_stats` holds what happened on this rank:
    engine, bytes, seconds, throughput.
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
        self.save_id = self._new_save_id()
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: dict[str, Any] = {}
        self._session: IOSession | None = None
        self._lock_fd: int | None = None

    # ----------------------------------------------------------- DCP protocol

    @staticmethod
    def _new_save_id() -> str:
        return time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(4)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._release_lock()
        self.save_id = self._new_save_id()
        self.last_stats = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = 0 if rank is None else int(rank)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
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
        self._engine()  # fail before any rank writes if the engine cannot run here
        return dataclasses.replace(plan, storage_data=_LocalInfo(self.rank, socket.gethostname()))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._acquire_lock()
        return [
            dataclasses.replace(plan, storage_data=_Assignment(self.save_id, rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = plan.storage_data
        if not isinstance(assignment, _Assignment):
            raise RuntimeError(
                "FastPersistWriter.write_data got a plan that did not pass through its "
                "prepare_global_plan (a custom save function?)"
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(self._write(assignment, plan.items, planner))
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t0 = time.perf_counter()
        directory = self._directory()
        try:
            layout = self._layout_from_results(results)
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
            finally:
                os.close(fd)
            os.replace(tmp, final)  # the commit point
            if self.options.sync_files:
                _fsync_dir(directory)
            self._remove_superseded(directory, {name for name, _ in layout.files})
        finally:
            self._release_lock()
        metadata.storage_data = layout
        self.last_stats["finish_seconds"] = time.perf_counter() - t0

    # ------------------------------------------------------------- internals

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

    def _write(self, assignment: _Assignment, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        t0 = time.perf_counter()
        cpu: list[tuple[WriteItem, Any]] = []
        cuda: list[tuple[WriteItem, torch.Tensor]] = []
        for item in items:
            data = planner.resolve_data(item)
            name = _item_name(item)
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"{name}: the planner resolved a bytes item to {type(data).__name__}, not BytesIO")
                cpu.append((item, data.getbuffer()))
                continue
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
                cuda.append((item, data.detach()))
            elif data.device.type == "cpu":
                cpu.append((item, tensor_bytes(data, name)))
            else:
                cpu.append((item, tensor_bytes(data.detach().cpu(), name)))
        resolve_s = time.perf_counter() - t0

        session = self._engine()
        directory = self._directory()
        results: list[WriteResult] = []
        stats: dict[str, Any] = {"engine": session.kind, "direct_io": session.direct, "bytes": 0, "requests": 0}
        if cpu:
            name = fmt.data_file_name(assignment.save_id, assignment.rank, 0)
            lengths = [len(buf) for _, buf in cpu]
            offsets, end = place_extents(
                lengths, session.alignment, self.options.pack_threshold_bytes, self.options.pack_alignment_bytes
            )
            s = session.write(
                [os.path.join(directory, name)],
                np.zeros(len(cpu), dtype=np.int64),
                np.asarray(offsets, dtype=np.int64),
                [buf for _, buf in cpu],
                sync=self.options.sync_files,
            )
            _add_stats(stats, s)
            results += _results(cpu, lengths, offsets, name, align_up(end, session.alignment))
        if cuda:
            name = fmt.data_file_name(assignment.save_id, assignment.rank, 1)
            results += self._write_cuda(session, directory, name, cuda, stats)
        seconds = time.perf_counter() - t0
        stats.update(
            seconds=seconds,
            resolve_seconds=resolve_s,
            gbps=stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
            items=len(items),
        )
        self.last_stats = stats
        return results

    def _write_cuda(
        self,
        session: IOSession,
        directory: str,
        name: str,
        items: list[tuple[WriteItem, torch.Tensor]],
        stats: dict[str, Any],
    ) -> list[WriteResult]:
        """Copy CUDA tensors to the host through two page-locked buffers on a
        side stream, chunk by chunk, writing chunk k while chunk k+1 is copied."""
        align = session.alignment
        flat = [t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8) for _, t in items]
        lengths = [int(f.numel()) for f in flat]
        # Every CUDA extent starts aligned, so chunk windows never share a block.
        offsets, end = place_extents(lengths, align, 0, align)
        chunk = align_up(min(self.options.cuda_chunk_bytes, max(end, align)), align)
        path = os.path.join(directory, name)
        buffers = [PinnedBuffer(chunk, align) for _ in range(2)]
        device = flat[0].device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the tensors' producers first
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-cuda-write")
        fd = session.engine.open(path, "w", session.direct if session.direct else False)
        pending: list[concurrent.futures.Future | None] = [None, None]
        try:
            for k, start in enumerate(range(0, align_up(end, align), chunk)):
                slot = k % 2
                if pending[slot] is not None:
                    _add_stats(stats, pending[slot].result())  # buffer free again
                stop = start + chunk
                host = buffers[slot].tensor
                srcs, offs = [], []
                with torch.cuda.stream(stream):
                    for f, off, n in zip(flat, offsets, lengths):
                        a, b = max(off, start), min(off + n, stop)
                        if b <= a:
                            continue
                        host[a - start : b - start].copy_(f[a - off : b - off], non_blocking=True)
                        srcs.append(memoryview(buffers[slot].raw)[a - start : b - start])
                        offs.append(a)
                event = torch.cuda.Event()
                event.record(stream)
                event.synchronize()
                if srcs:
                    pending[slot] = pool.submit(
                        session.write_fds, [fd], [path], np.zeros(len(srcs), np.int64), np.asarray(offs, np.int64), srcs, sync=False
                    )
            for p in pending:
                if p is not None:
                    _add_stats(stats, p.result())
            if self.options.sync_files:
                os.fdatasync(fd)
        finally:
            for p in pending:
                if p is not None:
                    p.exception()  # wait before the buffers go away
            pool.shutdown(wait=True)
            os.close(fd)
            pending = srcs = host = None  # drop the views before freeing the buffers
            for b in buffers:
                b.close()
        return _results(items, lengths, offsets, name, align_up(end, align))

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
                for fname, fo, io_, ln in written.extents:
                    fid = files.setdefault(fname, len(files))
                    extents.setdefault(wr.index, []).append(fmt.Extent(fid, fo, io_, ln))
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

    def _acquire_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = os.path.join(self._directory(), _LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(
                11, "another fp_dcp save into this checkpoint directory is in progress; wait for it "
                "or save elsewhere", self._directory()
            ) from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        """Release the engine, its page-locked buffers and any lock now (after
        the async save in flight, if any, and the staging arena)."""
        self._close_staging()
        self._release_lock()
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> "FastPersistWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _add_stats(stats: dict[str, Any], s: dict[str, Any]) -> None:
    stats["bytes"] += s.get("bytes", 0)
    stats["requests"] += s.get("requests", 0)
    stats["zero_copy_bytes"] = stats.get("zero_copy_bytes", 0) + s.get("zero_copy_bytes", 0)


def _results(pairs, lengths, offsets, file_name: str, file_size: int) -> list[WriteResult]:
    out = []
    for k, ((item, _), n, off) in enumerate(zip(pairs, lengths, offsets)):
        out.append(
            WriteResult(
                index=item.index,
                size_in_bytes=n,
                storage_data=_Written(
                    extents=((file_name, off, 0, n),),
                    file_sizes=((file_name, file_size),) if k == 0 else (),
                ),
            )
        )
    return out


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
