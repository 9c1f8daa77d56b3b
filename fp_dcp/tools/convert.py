"""``fp-dcp inspect`` and ``fp-dcp convert``: :func:`describe`,
:func:`to_torch_save`, :func:`to_safetensors` (streamed from fp_dcp), and
:func:`fp_dcp_to_dcp` / :func:`dcp_to_fp_dcp` (whole state dict in memory)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
import sys
import time
from typing import Any, Callable, Iterator

import torch

from fp_dcp import files
from fp_dcp import format as fmt
from fp_dcp.options import format_size

__all__ = [
    "Progress",
    "checkpoint_kind",
    "describe",
    "to_torch_save",
    "to_safetensors",
    "fp_dcp_to_dcp",
    "dcp_to_fp_dcp",
    "torch_save_to_fp_dcp",
    "load_fp_dcp",
    "SAFETENSORS_DTYPES",
]

# torch dtype -> safetensors dtype name (the format's specification)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}


class ConvertError(ValueError):
    """A conversion that cannot be done as asked; the message says what to do."""


# ------------------------------------------------------------------ progress


class Progress:
    """Progress of a long operation on stderr: a self-rewriting line on a
    terminal, a line every 10% otherwise; nothing when ``enabled`` is False."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream: Any = None) -> None:
        self.label, self.total, self.enabled = label, max(int(total), 0), enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last_t = 0.0
        self.last_decile = -1
        self.done = 0
        self.base = 0  # bytes finished before the current step (added to what a step reports)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        self.done = done
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = done / self.total if self.total else 1.0
        if self.tty:
            if now - self.last_t < 0.2 and done < self.total:
                return
            self.last_t = now
            self.stream.write(f"\r{self._line(frac, now)}")
        else:
            decile = int(frac * 10)
            if decile == self.last_decile:
                return
            self.last_decile = decile
            self.stream.write(self._line(frac, now) + "\n")
        self.stream.flush()

    def _line(self, frac: float, now: float) -> str:
        dt = now - self.t0
        rate = self.done / dt / 1e9 if dt > 0 else 0.0
        done, total = format_size(self.done), format_size(self.total)
        return f"{self.label}: {done} / {total} ({100 * frac:5.1f}%) {rate:.2f} GB/s"

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------ what is it


def checkpoint_kind(path: str) -> str:
    """``"fp_dcp"``, ``"dcp"`` (a stock DCP directory), ``"torch"`` (a file) or
    raise naming the path and what was expected."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, fmt.METADATA_NAME)):
            return "fp_dcp"
        if os.path.exists(os.path.join(path, fmt.STOCK_METADATA_NAME)):
            return "dcp"
        raise ConvertError(
            f"{path}: neither an fp_dcp checkpoint (no {fmt.METADATA_NAME}) nor a stock DCP checkpoint "
            f"(no {fmt.STOCK_METADATA_NAME}); give the directory a save wrote into"
        )
    if os.path.isfile(path):
        return "torch"
    raise FileNotFoundError(2, "no such checkpoint (give a checkpoint directory or a torch.save file)", path)


def describe(path: str) -> dict[str, Any]:
    """An fp_dcp checkpoint's metadata as plain (JSON-able) data."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fp_dcp.files import lstat_data_file, read_metadata_bytes

    meta_path = os.path.join(path, fmt.METADATA_NAME)
    data = read_metadata_bytes(path)
    version, _, _ = fmt.read_header(data, meta_path)
    md, layout, extra = fmt.decode_metadata(data, meta_path)
    tensors, others = [], []
    extents: dict[str, list[fmt.Extent]] = {}
    for index, exts in layout.extents.items():
        extents.setdefault(index.fqn, []).extend(exts)
    for name, item in sorted(md.state_dict_metadata.items()):
        exts = extents.get(name, [])
        item_files = sorted({e.file for e in exts})
        if isinstance(item, TensorStorageMetadata):
            esize = item.properties.dtype.itemsize
            tensors.append({
                "name": name,
                "dtype": str(item.properties.dtype).replace("torch.", ""),
                "shape": list(item.size),
                "bytes": math.prod(item.size) * esize,
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
                "extents": len(exts),
                "files": item_files,
            })
        else:
            others.append({"name": name, "bytes": sum(e.length for e in exts), "files": item_files})
    files = []
    for i, ((name, size), full) in enumerate(zip(layout.files, fmt.data_file_paths(path, layout))):
        try:
            on_disk = lstat_data_file(full).st_size
        except (OSError, fmt.CheckpointFormatError):
            on_disk = None  # missing, or not a regular file: not followed
        files.append({"index": i, "name": name, "size": size, "size_on_disk": on_disk})
    return {
        "path": os.path.abspath(path),
        "format": fmt.FORMAT_NAME,
        "format_version": version,
        "writer": extra.get("writer"),
        "torch_version": extra.get("torch_version"),
        "created": extra.get("created"),
        "world_size": extra.get("world_size"),
        "save_id": layout.save_id,
        "alignment": layout.alignment,
        "checksum_block_bytes": getattr(layout, "checksum_block_bytes", None),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "objects": others,
        "files": files,
        "file_bytes": sum(f["size"] for f in files),
    }


# ------------------------------------------------------------------ loading


def load_fp_dcp(path: str, keys: list[str] | None = None, progress: Progress | None = None, **options: Any) -> dict:
    """The whole checkpoint (or the flattened ``keys``) as a state dict of
    whole CPU tensors, in one process.  With ``keys`` the result is flat
    (keys as stored); without, nested as it was saved."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from fp_dcp.load.reader import FastPersistReader

    reader = FastPersistReader(path, **options)
    if progress is not None:
        reader.progress = lambda done, total: progress.update(progress.base + done)
    try:
        sd: dict[str, Any] = {}
        if keys is None:
            _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            return sd
        md = reader.read_metadata()
        for k in keys:
            item = md.state_dict_metadata[k]
            sd[k] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        _load_state_dict(sd, storage_reader=reader, no_dist=True)
        return sd
    finally:
        reader.close()


def _total_bytes(path: str) -> int:
    d = describe(path)
    return d["tensor_bytes"] + sum(o["bytes"] for o in d["objects"])


@contextlib.contextmanager
def _atomic_output(out: str, force: bool) -> Iterator[tuple[int, str]]:
    """``(descriptor, path)`` of the output's temporary beside ``out`` (``O_EXCL |
    O_NOFOLLOW``), renamed over ``out`` at the end, removed on failure."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        root = files.Root(parent)
    except (FileNotFoundError, NotADirectoryError):
        raise ConvertError(f"{out}: the directory {parent} does not exist; create it first") from None
    with root:
        leaf = os.path.basename(out)
        if root.exists(leaf) and not force:
            raise ConvertError(f"{out}: already exists; remove it or pass --force to replace it")
        with root.atomic_file(leaf, tmp_name=f"{leaf}.fp_dcp-tmp-{os.getpid()}-{secrets.token_hex(4)}") as (fd, _):
            yield fd, f"/proc/self/fd/{fd}"


# ------------------------------------------------------------------ conversions


def to_torch_save(src: str, out: str, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """fp_dcp checkpoint (streamed: memory holds only the non-tensor values) or a
    stock DCP one (loaded whole) -> one ``torch.save`` file."""
    kind = checkpoint_kind(src)
    if kind not in ("fp_dcp", "dcp"):
        raise ConvertError(f"{src}: already a torch.save file; nothing to convert")
    t0 = time.perf_counter()
    with _atomic_output(out, force) as (fd, tmp):
        if kind == "fp_dcp":
            _stream_torch_save(src, fd, tmp, progress)
        else:
            with os.fdopen(fd, "wb", closefd=False) as f:
                torch.save(_load_dcp(src), f)
    return {"output": out, "bytes": os.path.getsize(out), "seconds": time.perf_counter() - t0}


def _stream_torch_save(src: str, fd: int, tmp: str, progress: bool) -> None:
    """Write ``torch.save`` of an fp_dcp checkpoint without holding its bytes:
    an archive with empty tensor records (``skip_data``), mapped back shared and
    filled in place by the reader, so the bytes go through the page cache only."""
    import dataclasses
    import gc
    import mmap

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from fp_dcp.load.reader import FastPersistReader

    def only(kind_kept: LoadItemType, base: type) -> Any:
        class _Planner(base):  # type: ignore[misc, valid-type]
            def create_local_plan(self):
                plan = super().create_local_plan()
                return dataclasses.replace(plan, items=[i for i in plan.items if i.type == kind_kept])

        return _Planner()

    skeleton: dict[str, Any] = {}
    with FastPersistReader(src) as reader:
        allow_pickle = reader.options.allow_pickle  # the objects pass the restricted unpickler unless set
        planner = only(LoadItemType.BYTE_IO, _EmptyStateDictLoadPlanner)
        _load_state_dict(skeleton, storage_reader=reader, planner=planner, no_dist=True)
    with torch.serialization.skip_data(), os.fdopen(fd, "wb", closefd=False) as f:
        torch.save(skeleton, f)
    del skeleton
    p = Progress(f"reading {src}", describe(src)["tensor_bytes"], progress)  # the objects are read already
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        # the objects the checkpoint held, just written: rebuilt as safely as they were read
        mapped = torch.load(tmp, mmap=True, weights_only=not allow_pickle)
    try:
        with FastPersistReader(src) as reader:
            reader.progress = lambda done, total: p.update(done)
            _load_state_dict(mapped, storage_reader=reader, planner=only(LoadItemType.TENSOR, DefaultLoadPlanner),
                             no_dist=True)
    finally:
        p.close()
        del mapped
        gc.collect()  # unmap before the file is synced and renamed


def _flat_tensor_keys(path: str) -> tuple[list[tuple[str, torch.dtype, list[int]]], list[str]]:
    from fp_dcp.load.reader import read_checkpoint_metadata

    md, _, _ = read_checkpoint_metadata(path)
    return tensor_keys(md)


def tensor_keys(md: Any) -> tuple[list[tuple[str, torch.dtype, list[int]]], list[str]]:
    """A DCP ``Metadata``'s tensors as (key, dtype, shape), and its other keys."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, others = [], []
    for name, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors.append((name, item.properties.dtype, list(item.size)))
        else:
            others.append(name)
    return tensors, others


def safetensors_header(entries: list[tuple[str, torch.dtype, list[int]]],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The header bytes (length prefix included, padded to 8 bytes) of a
    safetensors file holding ``entries`` (name, dtype, shape) in this order,
    and each tensor's offset in the data section."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape in entries:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise ConvertError(
                f"{name}: safetensors has no {dtype}; convert to torch.save instead (--to torch), pass "
                f"--skip-unsupported to leave such tensors out, or store it as a supported dtype "
                f"({', '.join(sorted(SAFETENSORS_DTYPES.values()))})"
            )
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + 8) % 8)
    return struct.pack("<Q", len(body)) + body, offsets


def to_safetensors(src: str, out: str, *, force: bool = False, progress: bool = True,
                   batch_bytes: int = 1 << 30, skip_unsupported: bool = False) -> dict[str, Any]:
    """fp_dcp checkpoint -> one ``.safetensors`` file, tensor by tensor.
    Tensors of a dtype safetensors lacks are an error, or with
    ``skip_unsupported`` left out and listed in ``skipped``."""
    if checkpoint_kind(src) != "fp_dcp":
        raise ConvertError(f"{src}: to_safetensors reads fp_dcp checkpoints; convert it first "
                           f"(fp-dcp convert --from-dcp {src} DIR)")
    tensors, others = _flat_tensor_keys(src)
    tensors.sort(key=lambda t: t[0])
    if skip_unsupported:
        others += [name for name, dtype, _ in tensors if dtype not in SAFETENSORS_DTYPES]
        tensors = [t for t in tensors if t[1] in SAFETENSORS_DTYPES]
    head, _ = safetensors_header(tensors, {"format": "pt", "converted_by": "fp_dcp"})
    total = sum(math.prod(s) * d.itemsize for _, d, s in tensors)
    p = Progress(f"converting {src}", total, progress)
    t0 = time.perf_counter()
    try:
        with _atomic_output(out, force) as (fd, _), os.fdopen(fd, "wb", closefd=False) as f:
            f.write(head)
            done = 0
            for batch in _batches(tensors, batch_bytes):
                p.base = done
                sd = load_fp_dcp(src, [name for name, _, _ in batch], progress=p)
                for name, _, _ in batch:
                    t = sd.pop(name).contiguous()
                    if t.numel():
                        f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                    done += t.numel() * t.element_size()
                p.update(done)
    finally:
        p.close()
    return {"output": out, "bytes": os.path.getsize(out), "tensors": len(tensors), "skipped": sorted(others),
            "seconds": time.perf_counter() - t0}


def _batches(tensors, limit: int) -> Iterator[list]:
    batch: list[tuple] = []
    size = 0
    for t in tensors:
        n = math.prod(t[2]) * t[1].itemsize
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += n
    if batch:
        yield batch


def _load_dcp(src: str) -> dict:
    """A stock DCP checkpoint's state dict, read without running its code (:mod:`fp_dcp.load.stock`)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from fp_dcp.load.stock import SafeStockReader

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=SafeStockReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def _save_dir(sd: dict, out: str, writer_factory: Callable[[str], Any], force: bool) -> None:
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    try:
        root = files.Root(out, create=True, follow=False)
    except files.UnsafePathError:
        raise ConvertError(f"{out}: is a symbolic link; give a real directory (the checkpoint would be written "
                           f"wherever it points)") from None
    with root:
        if root.entries() and not force:
            raise ConvertError(f"{out}: exists and is not empty; give a new directory or pass --force")
    _save_state_dict(sd, storage_writer=writer_factory(out), no_dist=True)


def fp_dcp_to_dcp(src: str, out: str, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """fp_dcp checkpoint -> stock DCP checkpoint (``FileSystemWriter``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    if checkpoint_kind(src) != "fp_dcp":
        raise ConvertError(f"{src}: not an fp_dcp checkpoint (--to-dcp converts one into a stock DCP checkpoint)")
    t0 = time.perf_counter()
    p = Progress(f"reading {src}", _total_bytes(src), progress)
    sd = load_fp_dcp(src, progress=p)
    p.close()
    _save_dir(sd, out, FileSystemWriter, force)
    return {"output": out, "seconds": time.perf_counter() - t0}


def dcp_to_fp_dcp(src: str, out: str, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Stock DCP checkpoint (or a torch.save file) -> fp_dcp checkpoint."""
    from fp_dcp.save.writer import FastPersistWriter

    kind = checkpoint_kind(src)
    t0 = time.perf_counter()
    if kind == "dcp":
        sd = _load_dcp(src)
    elif kind == "torch":
        sd = torch.load(src, map_location="cpu", weights_only=True)
    else:
        raise ConvertError(f"{src}: already an fp_dcp checkpoint (--from-dcp reads a stock DCP checkpoint)")
    _save_dir(sd, out, FastPersistWriter, force)
    return {"output": out, "seconds": time.perf_counter() - t0}


def torch_save_to_fp_dcp(src: str, out: str, **kw: Any) -> dict[str, Any]:
    return dcp_to_fp_dcp(src, out, **kw)
