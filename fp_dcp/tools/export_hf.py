"""Export a checkpoint to Hugging Face's layout: what ``fp-dcp export-hf`` runs.

The output is what ``transformers``' ``save_pretrained`` writes with
safetensors: ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
"weight_map": {...}}``), or one ``model.safetensors`` when everything fits in
one shard.  Shards are split as ``huggingface_hub`` splits a state dict (in
the checkpoint's order, a new shard when the next tensor would pass
``max_shard_size``), and each file's bytes are those ``safetensors`` writes
(tensors ordered by dtype then name, ``{"format": "pt"}`` metadata).

Only tensors are exported: other items are listed in ``skipped``.  The
source is an fp_dcp checkpoint or a stock DCP one; sharded (DTensor) tensors
are written whole.  Each file is laid out in memory as it is on disk, in
batches that the reader fills in place while the previous batch is written
through fp_dcp's engine (O_DIRECT where the file system takes it), into a
temporary created with ``O_EXCL|O_NOFOLLOW`` and renamed once synced.
Memory: three batches (``batch_bytes``, at least the largest tensor).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import re
import secrets
import stat
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from fp_dcp.files import Root, UnsafePathError
from fp_dcp.tools import convert

__all__ = ["export_hf", "ExportError", "parse_shard_size", "plan_export", "assign_shards", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# what transformers and huggingface_hub remove from a directory they save into
_HF_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# safetensors' order of tensors in a file: by dtype (this order), then by name
_DTYPE_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
# batches in memory: one being written, one being filled, and one filled
# ahead, so that neither the reader nor the writer waits on the other's
# slowest request (measured: 64 MiB x 3 beats x 2, and larger batches fault
# in more memory than they save)
_SLOTS = 3
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class ExportError(convert.ConvertError):
    """An export that cannot be done as asked; the message says what to do."""


def parse_shard_size(value: int | str) -> int:
    """Bytes of a shard size given as Hugging Face does: an int, or a number and
    a unit, decimal (``"5GB"`` = 5 * 10**9, ``KB``/``MB``/``TB``) or binary
    (``"2GiB"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(value).upper())
        if m is None or m.group(2) not in _SIZE_UNITS:
            raise ExportError(f"max shard size {value!r}: give bytes or a number and a unit, e.g. 5GB "
                              f"(10**9), 500MB or 2GiB (2**30)")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if n <= 0:
        raise ExportError(f"max shard size {value!r}: must be positive, e.g. 5GB")
    return n


# ------------------------------------------------------------------ the plan (pure)


@dataclasses.dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: where it comes from and where it goes."""
    source: str  # the checkpoint's key
    name: str  # the key in the output
    stored_dtype: torch.dtype
    dtype: torch.dtype  # written as
    shape: tuple[int, ...]
    offset: int = 0  # in its file, from the file's start (header included)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ShardFile:
    """One output file: its name, header bytes, and tensors in file order."""
    filename: str
    header: bytes
    tensors: tuple[OutTensor, ...]
    size: int  # bytes of the whole file


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    files: tuple[ShardFile, ...]
    total_size: int  # tensor bytes, as HF's index counts them
    skipped: tuple[str, ...]  # non-tensor items and keys the key map dropped

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def index(self) -> dict[str, Any]:
        weight_map = {t.name: f.filename for f in self.files for t in f.tensors}
        return {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}


def _key_mapper(strip_prefix: str | Sequence[str] | None,
                key_map: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    prefixes = [strip_prefix] if isinstance(strip_prefix, str) else list(strip_prefix or [])

    def mapped(key: str) -> str | None:
        for p in prefixes:
            if p and key.startswith(p):
                key = key[len(p):]
                break
        return key_map(key) if key_map is not None else key
    return mapped


def plan_export(tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], *, max_shard_size: int | str = "5GB",
                dtype: torch.dtype | None = None, strip_prefix: str | Sequence[str] | None = None,
                key_map: Callable[[str], str | None] | None = None,
                skipped: Sequence[str] = ()) -> ExportPlan:
    """The files, their headers and every tensor's place, from the checkpoint's
    (key, dtype, shape) list in its order.  ``strip_prefix`` is removed from
    keys that start with it (the first that matches), then ``key_map`` gives
    the output key (None leaves the tensor out).  ``dtype`` casts the
    floating-point tensors."""
    limit = parse_shard_size(max_shard_size)
    mapper = _key_mapper(strip_prefix, key_map)
    out: list[OutTensor] = []
    seen: dict[str, str] = {}
    dropped = list(skipped)
    for key, stored, shape in tensors:
        name = mapper(key)
        if name is None:
            dropped.append(key)
            continue
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ExportError(f"{key}: the key map gave {name!r}; give a non-empty string other than "
                              f"__metadata__, or None to leave the tensor out")
        if name in seen:
            raise ExportError(f"{key} and {seen[name]} both become {name!r} in the output; change "
                              f"--strip-prefix or the key map so that keys stay distinct")
        seen[name] = key
        target = dtype if dtype is not None and stored.is_floating_point else stored
        if target not in convert.SAFETENSORS_DTYPES:
            raise ExportError(f"{key}: safetensors has no {target}; leave it out with a key map returning None, "
                              f"or export with fp-dcp convert --to torch")
        out.append(OutTensor(key, name, stored, target, tuple(int(s) for s in shape)))
    groups: list[list[OutTensor]] = []  # huggingface_hub's split_state_dict_into_shards_factory
    current: list[OutTensor] = []
    size = 0
    for t in out:
        if t.nbytes > limit:
            groups.append([t])
            continue
        if current and size + t.nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    files = []
    for i, group in enumerate(groups):
        name = SINGLE_NAME if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        order = sorted(group, key=lambda t: (_DTYPE_ORDER.index(convert.SAFETENSORS_DTYPES[t.dtype]), t.name))
        header, offsets = convert.safetensors_header([(t.name, t.dtype, list(t.shape)) for t in order],
                                                     {"format": "pt"})
        placed = tuple(dataclasses.replace(t, offset=len(header) + o) for t, o in zip(order, offsets))
        files.append(ShardFile(name, header, placed, len(header) + sum(t.nbytes for t in order)))
    return ExportPlan(tuple(files), sum(t.nbytes for t in out), tuple(dropped))


def assign_shards(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that writes each file: the largest first, each to the rank with
    the fewest bytes so far (ties: the lowest rank).  The same on every rank."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


# ------------------------------------------------------------------ batches (pure)


@dataclasses.dataclass(frozen=True)
class _Batch:
    """File bytes ``[base, end)`` of one file, laid out in one arena from
    ``base`` (aligned): the bytes before the first tensor come from the
    previous batch (or are the header); ``[base, write_end)`` is written."""
    file: ShardFile
    base: int
    tensors: tuple[OutTensor, ...]
    end: int
    write_end: int  # aligned, except for the file's last batch (its end)

    @property
    def first(self) -> bool:
        return self.base == 0

    @property
    def last(self) -> bool:
        return self.write_end == self.end


def _batches(f: ShardFile, capacity: int, align: int) -> Iterator[_Batch]:
    """``f``'s batches, each at most ``capacity`` bytes (which must hold the
    header or any tensor plus ``align``)."""
    base, end = 0, len(f.header)
    cur: list[OutTensor] = []
    for t in f.tensors:
        if t.offset + t.nbytes - base > capacity and end > base:
            cut = end // align * align
            yield _Batch(f, base, tuple(cur), end, cut)
            base, cur = cut, []
        cur.append(t)
        end = t.offset + t.nbytes
    yield _Batch(f, base, tuple(cur), end, end)


# ------------------------------------------------------------------ reading and writing


class _Source:
    """The checkpoint's reader, filling given tensors batch after batch."""

    def __init__(self, path: str, kind: str) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        if kind == "fp_dcp":
            from fp_dcp.load.reader import FastPersistReader
            self.reader: Any = FastPersistReader(path)
        else:
            from fp_dcp.load.stock import SafeStockReader
            self.reader = SafeStockReader(path)
        self._load, self._planner = _load_state_dict, DefaultLoadPlanner

    def fill(self, targets: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        if not targets:
            return
        try:
            self._load(targets, storage_reader=self.reader, planner=self._planner(), no_dist=True)
        except CheckpointException as e:  # one process: its one failure, which names the file
            failures = list(getattr(e, "failures", {}).values())
            cause = failures[0] if len(failures) == 1 else None
            if isinstance(cause, tuple):  # (exception, its stack)
                cause = cause[0]
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def close(self) -> None:
        close = getattr(self.reader, "close", None)
        if close is not None:
            close()


def _fill(source: _Source, b: _Batch, arena: torch.Tensor, prev: tuple[_Batch, torch.Tensor] | None) -> None:
    """Lay out ``b`` in ``arena``: header or the previous batch's tail, then the tensors, read in place."""
    if b.first:
        header = b.file.header
        arena[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    else:
        assert prev is not None and prev[0].file is b.file
        pb, parena = prev
        arena[:pb.end - b.base].copy_(parena[b.base - pb.base:pb.end - pb.base])
    targets: dict[str, torch.Tensor] = {}
    casts = []
    for t in b.tensors:
        view = arena[t.offset - b.base:t.offset - b.base + t.nbytes].view(t.dtype).view(t.shape)
        if t.dtype == t.stored_dtype:
            targets[t.source] = view
        else:
            targets[t.source] = torch.empty(t.shape, dtype=t.stored_dtype)
            casts.append((view, targets[t.source]))
    source.fill(targets)
    for view, loaded in casts:
        view.copy_(loaded)


def _pipeline(batches: Sequence[_Batch], fill: Callable[[_Batch, int, Any], None],
              write: Callable[[_Batch, int], None], slots: int) -> None:
    """``fill`` each batch into a free slot on a thread while ``write`` empties
    the slot filled before; ``fill`` gets the previous (batch, slot) too."""
    free: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    stopping = threading.Event()
    for s in range(slots):
        free.put(s)

    def produce() -> None:
        prev = None
        try:
            for b in batches:
                s = free.get()
                if s is None or stopping.is_set():
                    return
                fill(b, s, prev)
                prev = (b, s)
                ready.put((b, s, None))
        except BaseException as e:  # noqa: BLE001 - raised on the writing thread
            ready.put((None, None, e))

    thread = threading.Thread(target=produce, name="fp_dcp-export-read", daemon=True)
    thread.start()
    try:
        for _ in batches:
            b, s, error = ready.get()
            if error is not None:
                raise error
            write(b, s)
            free.put(s)
    finally:
        stopping.set()
        for _ in range(slots):
            free.put(None)
        thread.join()


def _write_files(files: Sequence[ShardFile], src: str, kind: str, root: Root, *, direct_io: bool | None,
                 batch_bytes: int, progress: bool) -> dict[str, Any]:
    """Write ``files`` into the directory ``root``, each through a temporary renamed once synced."""
    import numpy as np

    from fp_dcp import _native
    from fp_dcp.engine import IOSession
    from fp_dcp.options import FastPersistOptions

    if not files:
        return {"bytes": 0, "direct": None}
    options = FastPersistOptions.from_env()
    session = IOSession(options if direct_io is None else options.replace(direct_io=direct_io), root.path)
    align = session.alignment
    need = max([batch_bytes] + [len(f.header) for f in files] + [t.nbytes for f in files for t in f.tensors])
    capacity = -(-(need + align) // align) * align
    batches = [b for f in files for b in _batches(f, capacity, align)]
    # not prefaulted: the reader's first fill faults the pages in, overlapped with the writes
    buffers = [_native.AlignedBuffer(capacity, align, lock=False, prefault=False)
               for _ in range(min(_SLOTS, len(batches)))]
    arenas = [torch.frombuffer(buf, dtype=torch.uint8, count=capacity) for buf in buffers]
    source = _Source(src, kind)
    p = convert.Progress(f"exporting {src}", sum(f.size for f in files), progress)
    opened: dict[str, tuple[str, int]] = {}
    done = 0

    def fill(b: _Batch, s: int, prev: Any) -> None:
        _fill(source, b, arenas[s], None if b.first else (prev[0], arenas[prev[1]]))

    def write(b: _Batch, s: int) -> None:
        nonlocal done
        if b.first:
            opened[b.file.filename] = _create_temporary(root, b.file.filename, session.direct)
        tmp, fd = opened[b.file.filename]
        n = b.write_end - b.base
        if n:
            session.write_fds([fd], [root.join(tmp)], np.zeros(1, np.int64), np.array([b.base], np.int64),
                              [memoryview(buffers[s])[:n]], sync=False)
        if b.last:
            os.ftruncate(fd, b.file.size)  # the engine wrote up to the aligned end
            os.fsync(fd)
            del opened[b.file.filename]
            os.close(fd)
            root.rename(tmp, b.file.filename)
        done += n
        p.update(done)

    try:
        _pipeline(batches, fill, write, len(buffers))
        root.sync()  # this rank's renames
    finally:
        p.close()
        for tmp, fd in opened.values():
            os.close(fd)
            root.unlink(tmp)
        source.close()
        session.close()
        arenas.clear()  # the views go before the memory
        for buf in buffers:
            try:
                buf.close()
            except BufferError:  # a view still held (by a traceback): freed with it
                pass
    return {"bytes": done, "direct": session.direct}


def _create_temporary(root: Root, name: str, direct: bool) -> tuple[str, int]:
    tmp = f".{name}.{secrets.token_hex(4)}.fp_dcp-tmp"
    # open_fd adds O_NOFOLLOW | O_CLOEXEC
    return tmp, root.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0))


# ------------------------------------------------------------------ the output directory


def _prepare_out(out: str, overwrite: bool) -> None:
    """Create ``out``, or accept it: a real directory, empty unless ``overwrite``."""
    parent, name = os.path.split(os.path.abspath(out))
    with Root(parent, create=True) as above:
        try:
            st = above.lstat(name)
        except FileNotFoundError:
            above.mkdir(name)
            return
        if stat.S_ISLNK(st.st_mode):
            raise ExportError(f"{out}: a symbolic link; export-hf does not write through one: give the real "
                              f"directory ({os.path.realpath(out)}) or a new name")
        if not stat.S_ISDIR(st.st_mode):
            raise ExportError(f"{out}: exists and is not a directory; give a new directory name")
        with above.sub(name) as there:
            if there.entries() and not overwrite:
                raise ExportError(f"{out}: exists and is not empty; give a new directory, or pass --overwrite "
                                  f"(overwrite=True) to replace the model files in it")


def _finish(plan: ExportPlan, root: Root) -> list[str]:
    """Remove the model files of an earlier export that this one does not
    replace, write the index (sharded) and sync the directory; the names removed."""
    keep = {f.filename for f in plan.files} | ({INDEX_NAME} if plan.sharded else set())
    removed = []
    for name, kind in sorted(root.entries()):
        if kind == "file" and _HF_FILE.fullmatch(name) and name not in keep:
            root.unlink(name)
            removed.append(name)
    if plan.sharded:
        root.replace_bytes(INDEX_NAME, (json.dumps(plan.index(), indent=2, sort_keys=True) + "\n").encode())
    root.sync()
    return removed


# ------------------------------------------------------------------ ranks


class _Ranks:
    """This process's place in ``process_group`` (alone when None), and steps
    that every rank finishes before any goes on, failing together."""

    def __init__(self, process_group: Any) -> None:
        self.group = process_group
        self.rank, self.size = 0, 1
        if process_group is not None:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(process_group), dist.get_world_size(process_group)

    def step(self, what: str, fn: Callable[[], Any]) -> Any:
        error, result = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every rank learns of it first
            error = e
        failed = 0 if error is None else 1
        if self.group is not None:
            import torch.distributed as dist

            device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
            flag = torch.tensor([failed], dtype=torch.int64, device=device)
            dist.all_reduce(flag, group=self.group)
            failed = int(flag.item())
        if error is not None:
            raise error
        if failed:
            raise ExportError(f"{what}: {failed} of {self.size} ranks failed (their errors say why); "
                              f"rank {self.rank} stopped with them")
        return result


# ------------------------------------------------------------------ the entry point


def _source_tensors(path: str, kind: str) -> tuple[list[tuple[str, torch.dtype, list[int]]], list[str]]:
    if kind == "fp_dcp":
        return convert._flat_tensor_keys(path)  # checks the data files are all there, whole
    from fp_dcp.load.stock import SafeStockReader

    return convert.tensor_keys(SafeStockReader(path).read_metadata())


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: give one of {', '.join(DTYPES)} (or a torch.dtype)")
    return DTYPES[dtype]


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, max_shard_size: int | str = "5GB",
              dtype: str | torch.dtype | None = None, strip_prefix: str | Sequence[str] | None = None,
              key_map: Callable[[str], str | None] | None = None, overwrite: bool = False,
              process_group: Any = None, progress: bool = False, batch_bytes: int = 64 << 20,
              direct_io: bool | None = None) -> dict[str, Any]:
    """Write the tensors of ``checkpoint`` (fp_dcp or stock DCP) into ``out`` in
    Hugging Face's layout: safetensors shards of at most ``max_shard_size``
    (``"5GB"``; a larger tensor gets a shard of its own) and
    ``model.safetensors.index.json``, or one ``model.safetensors``.

    ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype) casts the
    floating-point tensors; ``strip_prefix`` drops a key prefix, then
    ``key_map(key)`` gives the output key (None leaves the tensor out).
    ``out`` is created, or must be an empty directory unless ``overwrite``
    (which replaces the model files there); a symbolic link is refused.
    With ``process_group`` every rank of it calls this with the same
    arguments and writes its share of the shards; rank 0 writes the index
    once all are written.  ``direct_io=False`` writes through the page cache.

    Returns ``files`` (all), ``written`` (this rank's), ``skipped`` (items
    that are not tensors, keys the key map dropped), ``total_size``,
    ``bytes`` (written by this rank), ``seconds``."""
    t0 = time.perf_counter()
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    ranks = _Ranks(process_group)

    def plan_it() -> tuple[str, ExportPlan]:
        kind = convert.checkpoint_kind(checkpoint)
        if kind == "torch":
            raise ExportError(f"{checkpoint}: a torch.save file, not a checkpoint directory; make it one first "
                              f"(fp-dcp convert {checkpoint} DIR --to fp_dcp), then export DIR")
        tensors, others = _source_tensors(checkpoint, kind)
        return kind, plan_export(tensors, max_shard_size=max_shard_size, dtype=_as_dtype(dtype),
                                 strip_prefix=strip_prefix, key_map=key_map, skipped=others)

    kind, plan = ranks.step("reading the checkpoint", plan_it)
    ranks.step("preparing the output", lambda: _prepare_out(out, overwrite) if ranks.rank == 0 else None)
    owners = assign_shards([f.size for f in plan.files], ranks.size)
    mine = [f for f, r in zip(plan.files, owners) if r == ranks.rank]
    roots: list[Root] = []

    def write_mine() -> dict[str, Any]:
        try:
            roots.append(Root(out, follow=False))
        except UnsafePathError as e:
            raise ExportError(f"{out}: a symbolic link or not a directory ({e.strerror}); give a real "
                              f"directory") from None
        return _write_files(mine, checkpoint, kind, roots[0], direct_io=direct_io, batch_bytes=batch_bytes,
                            progress=progress)

    try:
        stats = ranks.step("writing the shards", write_mine)
        removed = ranks.step("writing the index", lambda: _finish(plan, roots[0]) if ranks.rank == 0 else [])
    finally:
        for root in roots:
            root.close()
    return {
        "output": out,
        "files": [f.filename for f in plan.files] + ([INDEX_NAME] if plan.sharded else []),
        "written": [f.filename for f in mine],
        "tensors": sum(len(f.tensors) for f in plan.files),
        "skipped": list(plan.skipped),
        "removed": removed,
        "total_size": plan.total_size,
        "bytes": stats["bytes"],
        "direct": stats["direct"],
        "seconds": time.perf_counter() - t0,
    }
