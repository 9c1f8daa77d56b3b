"""``FastPersistReader``: a DCP ``StorageReader`` that reads only the bytes each
rank needs.

For every ``ReadItem`` (a box of a stored chunk that lands in a box of a
target tensor) the reader computes the byte runs of the stored row-major
chunk (:func:`fp_dcp.layout.box_runs`), maps them onto the stored extents,
and hands all pieces, sorted by file and offset, to the native engine, which
coalesces near neighbours into aligned requests and reads straight into the
target tensor wherever the target is a contiguous CPU tensor of the stored
dtype (otherwise into a bounded temporary and one copy).
"""

from __future__ import annotations

import io
import os
import secrets
import time
from torch.futures import Future
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from fp_dcp import format as fmt
from fp_dcp.engine import IOSession, tensor_bytes
from fp_dcp.layout import box_runs, check_extents_cover, map_runs_to_extents
from fp_dcp.options import FastPersistOptions

__all__ = ["FastPersistReader", "read_checkpoint_metadata"]

# Temporaries (targets that are not contiguous CPU tensors of the stored dtype)
# are read in batches of at most this many bytes.
_TEMP_BUDGET_BYTES = 256 << 20


def read_checkpoint_metadata(directory: str) -> tuple[Metadata, fmt.StorageLayout, dict[str, Any]]:
    """Read, validate and decode the metadata of the checkpoint in ``directory``,
    and check that its data files are all there and not truncated."""
    path = os.path.join(directory, fmt.METADATA_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if os.path.exists(os.path.join(directory, fmt.STOCK_METADATA_NAME)):
            raise fmt.CheckpointFormatError(
                f"{directory}: this is a stock torch.distributed.checkpoint checkpoint (it has "
                f"'{fmt.STOCK_METADATA_NAME}', not '{fmt.METADATA_NAME}'). Load it with "
                f"FileSystemReader, or convert it once: fp-dcp convert --from-dcp {directory} OUT"
            ) from None
        if not os.path.isdir(directory):
            raise FileNotFoundError(2, "no checkpoint directory here", directory) from None
        partial = any(n.endswith(fmt.DATA_SUFFIX) for n in os.listdir(directory))
        raise FileNotFoundError(
            2,
            "no committed fp_dcp checkpoint: the metadata file is missing"
            + (" (data files are there: a save was interrupted before its commit)" if partial else ""),
            path,
        ) from None
    metadata, layout, extra = fmt.decode_metadata(data, path)
    for name, size in layout.files:
        fpath = os.path.join(directory, name)
        try:
            actual = os.stat(fpath).st_size
        except FileNotFoundError:
            raise FileNotFoundError(
                2, "a data file of the checkpoint is missing; the checkpoint is damaged", fpath
            ) from None
        if actual < size:
            raise fmt.CheckpointFormatError(
                f"{fpath}: data file is truncated ({actual} bytes, the checkpoint recorded {size})"
            )
    return metadata, layout, extra


class FastPersistReader(StorageReader):
    """Load a checkpoint written by :class:`~fp_dcp.FastPersistWriter` from
    ``path``, into any world size and sharding.

    ``options`` / keyword arguments as for the writer (``engine``,
    ``coalesce_gap_bytes``, ...).  After each load :attr:`last_stats` holds
    this rank's bytes needed, bytes read from disk, seconds and engine.
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
        self.load_id = secrets.token_hex(8)
        self.layout: fmt.StorageLayout | None = None
        self.state_dict_metadata: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self._session: IOSession | None = None
        self._checked: set[MetadataIndex] = set()

    # ----------------------------------------------------------- DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = secrets.token_hex(8)
        self.layout = None
        self._checked = set()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        return os.path.exists(os.path.join(os.fspath(checkpoint_id), fmt.METADATA_NAME))

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def read_metadata(self, *args: Any) -> Metadata:
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

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        self._read(plan.items, planner)
        self.last_stats["seconds"] = time.perf_counter() - t0
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------- internals

    def _directory(self) -> str:
        if self.path is None:
            raise ValueError(
                "FastPersistReader has no path: pass FastPersistReader(path) or dcp.load(..., checkpoint_id=path)"
            )
        return self.path

    def _engine(self) -> IOSession:
        directory = self._directory()
        if self._session is None or not self._session.matches(self.options, directory):
            if self._session is not None:
                self._session.close()
            self._session = IOSession(self.options, directory)
        return self._session

    def _extents(self, index: MetadataIndex, nbytes: int) -> list[fmt.Extent]:
        assert self.layout is not None
        key = MetadataIndex(index.fqn, index.offset)
        exts = self.layout.extents.get(key)
        if exts is None:
            raise fmt.CheckpointFormatError(
                f"{self.path}: no stored bytes for {index.fqn}"
                + ("" if index.offset is None else f" (chunk at {list(index.offset)})")
                + "; the checkpoint metadata is inconsistent"
            )
        if key not in self._checked:
            check_extents_cover(index.fqn, exts, nbytes)
            self._checked.add(key)
        return exts

    def _chunk_sizes(self, req: ReadItem) -> tuple[list[int], torch.dtype]:
        md = self.state_dict_metadata.get(req.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise fmt.CheckpointFormatError(f"{req.storage_index.fqn}: not a tensor in the checkpoint")
        offset = req.storage_index.offset
        for chunk in md.chunks:
            if offset is None or chunk.offsets == offset:
                return list(chunk.sizes), md.properties.dtype
        raise fmt.CheckpointFormatError(
            f"{req.storage_index.fqn}: the checkpoint has no chunk at {list(offset)}"
        )

    def _read(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        session = self._engine()
        directory = self._directory()
        assert self.layout is not None
        paths = [os.path.join(directory, name) for name, _ in self.layout.files]
        stats = {"engine": session.kind, "bytes": 0, "bytes_read": 0, "requests": 0, "items": len(items)}

        batch: _ReadBatch = _ReadBatch()
        for req in items:
            if req.type == LoadItemType.BYTE_IO:
                exts = self.layout.extents.get(MetadataIndex(req.storage_index.fqn, req.storage_index.offset)) or []
                nbytes = sum(e.length for e in exts)
                self._extents(req.storage_index, nbytes)
                target = np.empty(nbytes, dtype=np.uint8)
                batch.add(req, target, None, None, *map_runs_to_extents(np.zeros(1, np.int64), nbytes, exts))
                continue
            sizes, dtype = self._chunk_sizes(req)
            esize = torch.empty((), dtype=dtype).element_size()
            exts = self._extents(req.storage_index, int(np.prod(sizes, dtype=np.int64)) * esize)
            starts, run_len = box_runs(sizes, list(req.storage_offsets), list(req.lengths), esize)
            dest = planner.resolve_tensor(req).detach()
            if list(dest.shape) != list(req.lengths):
                raise ValueError(
                    f"{req.dest_index.fqn}: the planner's target has shape {list(dest.shape)}, "
                    f"the read needs {list(req.lengths)}"
                )
            in_place = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
            target = dest if in_place else torch.empty(list(req.lengths), dtype=dtype)
            batch.add(req, tensor_bytes(target, req.dest_index.fqn), dest, None if in_place else target,
                      *map_runs_to_extents(starts, run_len, exts))
            if batch.temp_bytes >= _TEMP_BUDGET_BYTES:
                batch.flush(session, paths, planner, stats)
                batch = _ReadBatch()
        batch.flush(session, paths, planner, stats)
        self.last_stats = stats

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> "FastPersistReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ReadBatch:
    """Pieces of several read items, read by one engine call."""

    def __init__(self) -> None:
        self.entries: list[tuple[ReadItem, np.ndarray, torch.Tensor | None, torch.Tensor | None]] = []
        self.files: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.dests: list[memoryview] = []
        self.temp_bytes = 0

    def add(self, req, buf, dest, temp, files, offsets, lengths, positions) -> None:
        self.entries.append((req, buf, dest, temp))
        if temp is not None:
            self.temp_bytes += len(buf)
        view = memoryview(buf)
        self.files.append(files)
        self.offsets.append(offsets)
        self.dests.extend(view[p : p + n] for p, n in zip(positions.tolist(), lengths.tolist()))

    def flush(self, session: IOSession, paths, planner: LoadPlanner, stats: dict[str, Any]) -> None:
        if not self.entries:
            return
        files = np.concatenate(self.files) if self.files else np.zeros(0, np.int64)
        offsets = np.concatenate(self.offsets) if self.offsets else np.zeros(0, np.int64)
        order = np.lexsort((offsets, files))
        dests = [self.dests[i] for i in order.tolist()]
        used, local = np.unique(files, return_inverse=True)  # open only the files this batch reads
        s = session.read([paths[i] for i in used.tolist()], local[order].astype(np.int64), offsets[order], dests)
        for key in ("bytes", "bytes_read", "requests"):
            stats[key] += s.get(key, 0)
        dests.clear()
        self.dests.clear()
        for req, buf, dest, temp in self.entries:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(buf.tobytes()))
                continue
            if temp is not None:
                dest.copy_(temp)
            planner.commit_tensor(req, dest)
        self.entries.clear()
