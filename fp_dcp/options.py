"""Every tunable of fp_dcp in one place.

:class:`FastPersistOptions` is a frozen dataclass.  Each field can be set three
ways, strongest first:

1. an argument: ``FastPersistOptions(queue_depth=16)`` or
   ``FastPersistWriter(path, queue_depth=16)``;
2. an environment variable ``FP_DCP_<FIELD NAME IN CAPITALS>``
   (``FP_DCP_ENGINE=uring``), read when the options object is created;
3. the default below.

Sizes carry their unit in the name (``*_bytes``); environment values for them
accept suffixes (``64MiB``, ``4k``).  An unknown option name is an error that
lists the valid ones.  Tests use :func:`override` to run the same code with a
feature on and off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import typing
from typing import Any, Iterator

__all__ = ["FastPersistOptions", "OptionBoundError", "MAX_IN_FLIGHT_BYTES", "format_size", "override", "parse_size",
           "plural"]

# The most memory one engine's bounce buffers may take: queue_depth x
# block_size_bytes, each unset one counted at the engine's default (8
# requests, 4 MiB); eight times the built-in 32 MiB.
MAX_IN_FLIGHT_BYTES = 256 << 20
_DEFAULT_QUEUE_DEPTH = 8
_DEFAULT_BLOCK_BYTES = 4 << 20
# Upper bounds: each a size or count a real machine can meet (the memory an
# option implies is bounded; the docs state each bound in the field's line).
_UPPER = {
    "queue_depth": 1024,
    "block_size_bytes": 64 << 20,
    "alignment_bytes": 1 << 20,
    "pack_threshold_bytes": 64 << 20,
    "pack_alignment_bytes": 1 << 20,
    "coalesce_gap_bytes": 64 << 20,
    "cuda_chunk_bytes": 1 << 30,
    "split_alignment_bytes": 1 << 30,
    "read_buffer_budget_bytes": 64 << 30,
    "read_threads": 16,
    "max_overread_percent": 1000,
}

_ENV_PREFIX = "FP_DCP_"
# FP_DCP_* variables that are not options: FP_DCP_DEFAULT_STORAGE and
# FP_DCP_ALLOW_UNTESTED_TORCH (read by fp_dcp/_dcp_hooks.py), FP_DCP_TUNING_FILE
# (the per-user record of `fp-dcp tune`, "none" for no record: fp_dcp/tuning.py),
# FP_DCP_TEST_HOOKS (read by the extension, cython_io/_aio.pyx), FP_DCP_RANKS_PER_NODE
# (the tiers' node size: fp_dcp/tiers/topology.py)
_NOT_OPTIONS = frozenset({"FP_DCP_DEFAULT_STORAGE", "FP_DCP_ALLOW_UNTESTED_TORCH", "FP_DCP_TUNING_FILE",
                          "FP_DCP_TEST_HOOKS", "FP_DCP_RANKS_PER_NODE"})

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """A byte count from ``"64MiB"``-style text (-> 67108864); an int is returned as is.

    The text is a number (digits, optionally followed by a decimal
    fraction: ``"1.5GiB"``, not ``".5GiB"``), then an optional unit, with
    spaces allowed around both.  Units are case-insensitive and always
    binary, whatever their spelling:

    - none or ``B``: bytes;
    - ``K``, ``KB``, ``KiB``: 2**10;
    - ``M``, ``MB``, ``MiB``: 2**20 (so ``"1MB"`` is 1048576, not 10**6);
    - ``G``, ``GB``, ``GiB``: 2**30;
    - ``T``, ``TB``, ``TiB``: 2**40.

    A fractional result is truncated to whole bytes (``"1.5K"`` -> 1536,
    ``"0.3K"`` -> 307).  Anything else (a negative number, an unknown unit)
    is a ``ValueError``.  ``FP_DCP_*_BYTES`` environment variables, the
    ``--size`` of tools/demo.py and every size flag of benchmarks/ are read
    with it.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number with an optional unit "
            f"(B, KiB, MiB, GiB, TiB), e.g. '64MiB'"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "file")`` -> ``"1 file"``, ``plural(1200, "entry", "entries")`` -> ``"1,200 entries"``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def format_size(n: float, digits: int = 2) -> str:
    """67108864 -> ``"64.00 MiB"``: binary units, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


class OptionBoundError(ValueError):
    """An option past its upper bound: it would take more memory (or
    threads) than a machine can give a checkpoint."""


@dataclasses.dataclass(frozen=True)
class FastPersistOptions:
    """Options of :class:`~fp_dcp.FastPersistWriter` and :class:`~fp_dcp.FastPersistReader`.

    Attributes:
        engine: the asynchronous I/O engine: ``"auto"`` (kernel AIO or
            io_uring, whichever measured faster here, falling back to
            ``"threads"`` on file systems that refuse ``O_DIRECT``), ``"aio"``,
            ``"uring"`` or ``"threads"`` (a pool of ``pwrite``/``pread``
            threads).  The engine that ran is reported in
            ``writer.last_stats["engine"]``.
        direct_io: ``None`` opens files with ``O_DIRECT`` where the file
            system allows it and buffered otherwise; ``True`` requires
            ``O_DIRECT`` (an error where it is refused); ``False`` never uses it.
        queue_depth: requests kept in flight; ``None`` takes the engine's
            tuned default.  At most 1024, and ``queue_depth x
            block_size_bytes`` at most 256 MiB (an unset one counted as 8
            requests / 4 MiB): the bounce buffers of each engine.
        block_size_bytes: size of one request and of one bounce buffer;
            ``None`` takes the engine's tuned default.  A multiple of the
            file system's direct-I/O alignment.  With both ``None`` the
            requests are sized by what is moved and by the device: the
            writer sends 4 MiB x 8; the reader sends runs of 1 MiB and more
            as requests of the device's largest whole request
            (``max_sectors_kb``, bounded to 1-4 MiB, 32 MiB in flight) and
            shorter runs as 256 KiB x 64 (docs/NATIVE.md, "Request sizes"),
            unless ``fp-dcp tune`` recorded shapes for the device (its write
            shape for saves, its read shape for long runs; the record file is
            ``$FP_DCP_TUNING_FILE``, else ``~/.cache/fp_dcp/tuning.json``;
            ``FP_DCP_TUNING_FILE=none`` ignores records).
            Setting either one gives every request that one shape.  At most
            64 MiB (and see ``queue_depth``).
        alignment_bytes: alignment of offsets, lengths and memory for direct
            I/O; ``None`` asks the file system (``statx`` ``STATX_DIOALIGN``,
            else 4096).  At most 1 MiB.
        pack_threshold_bytes: extents smaller than this are packed back to
            back (at ``pack_alignment_bytes``) instead of each starting on an
            aligned block, so thousands of small tensors do not waste a block
            each.  Larger extents start aligned, so they are written and read
            without a copy.  At most 64 MiB.
        pack_alignment_bytes: alignment of packed small extents in the file
            (keeps every element naturally aligned when viewed in place).
            A power of two, at most 1 MiB.
        sync_files: make a save durable before it is reported: each rank
            runs ``fdatasync`` on its data files (and ``fsync`` on its
            sub-directory of each data directory); the coordinator runs
            ``fsync`` on the temporary metadata, then on the checkpoint
            directory (the data files' entries), renames the metadata into
            place (the commit) and runs ``fsync`` on the directory again
            (docs/FORMAT.md, "Commit protocol").  Turning it off makes a crash
            able to lose a checkpoint that was reported as saved.
        coalesce_gap_bytes: on load, two byte runs of one file closer than
            this are read by one request (bounded over-read).  At most 64 MiB.
        cuda_chunk_bytes: size of each of the two page-locked buffers through
            which CUDA tensors are copied to the host while the previous chunk
            is being written.  From 1 MiB to 1 GiB.
        overwrite: allow saving into a directory that holds a committed
            checkpoint.  The old checkpoint stays loadable until the new one
            commits.
        data_dirs: directories for the data files, one per storage device
            (mount point / NVMe drive) of a node; the ranks of a node stripe
            their bytes over them (see ``fp_dcp.save.balance``).  Empty (the
            default): the data files go in the checkpoint directory (one
            path, e.g. a shared file system).  Otherwise each rank writes
            under ``<data_dir>/<checkpoint name>-<hash of its path>/`` and the
            metadata, which stays in the checkpoint directory, records every
            data file's absolute path; a loading process must see the data
            directories at the same paths.  In the environment:
            ``FP_DCP_DATA_DIRS=/nvme0/ckpt:/nvme1/ckpt``.
        split_alignment_bytes: replicated items are divided among the ranks
            that hold them by byte range; split points lie at multiples of
            this (raised to the direct-I/O alignment) from the item's start.
            A power of two, at most 1 GiB.  Items smaller than
            ``pack_threshold_bytes`` are never split.
        staging: how ``dcp.async_save`` stages (copies) the state dict into
            the writer's host arena (``fp_dcp.staging.stager``): ``"eager"`` copies
            before ``async_save`` returns; ``"lazy"`` returns at once and
            copies in the background (CPU: memcpy with the GIL released;
            CUDA: a side stream), and ``async_save`` returns
            ``AsyncSaveResponse``: wait on ``staging_completion`` before
            changing the state (before ``optimizer.step()``).
        staging_memory_limit_bytes: the most host memory the staging arena
            may take (``None``: as much as the state dict needs).  Past it,
            the tensors that do not fit stream through a ring of two slots
            into a spill file, and staging completes only when they are
            written there: the training waits for those bytes at disk speed.
        staging_shared_memory: stage into shared memory (a ``memfd``) that
            ``AsyncCheckpointerType.PROCESS`` hands to the checkpoint process
            as one handle.  ``None``: start private and switch to shared the
            first time a staged state dict is sent to a checkpoint process
            (that save pays one extra copy); ``True``: shared from the first
            save; ``False``: never (PROCESS mode then pays torch's per-tensor
            shared-memory copies).
        staging_checksums: compute the CRC-32C blocks (``write_checksums``)
            of CPU tensors in the staging copy itself, one pass over memory,
            so that the writer does not read the arena again to checksum it:
            about a quarter less CPU per save in all (what a checkpoint
            takes from the training), for a staging copy about a fifth
            slower than a plain memcpy (measured on the 2-core VM).
            ``False``: a plain memcpy, the shortest eager ``async_save``.
        staging_spill_dir: where the spill file of
            ``staging_memory_limit_bytes`` goes (unlinked at once; nothing
            is left behind); ``None``: the checkpoint directory.
        read_buffer_budget_bytes: on load, the most memory the reader's
            temporaries take (targets of another dtype or device, dense
            slices read as whole ranges and copied out with one strided
            copy, the boxes and parts of the ``share_*`` options: a quarter
            of it per round, at most four rounds alive at once, so larger budgets
            mean fewer, larger rounds); a stored chunk is never read whole
            to be sliced.  From 1 MiB to 64 GiB.
        read_threads: on load, engines of large requests that read the long
            runs (large tensors, packed small ones) at the same time, each on
            its own thread, which copies its requests out of its bounce
            buffers (with their checksums) on its own core; each takes at
            least 64 MiB of a batch and keeps its own bounce buffers (32 MiB
            by the built-in rule).  For a device that reads faster than one
            core copies; on this project's VM (4.5 GB/s disk, 2 cores) two
            were no faster than one (docs/NATIVE.md, "Request sizes").
            From 1 to 16.
        max_overread_percent: on load, bytes read beyond those the targets
            need, in percent of them, that the reader may spend to merge
            nearby pieces into fewer requests (gaps of at most
            ``coalesce_gap_bytes``).  Gaps that hold no whole alignment
            block are always read through (their blocks are read anyway).
            From 0 to 1000.
        strict_dtype: on load, a target tensor whose dtype differs from the
            stored one is an error naming the tensor, instead of being cast
            as the stock reader does.
        share_replicated_reads: on load, a box that several ranks need
            (e.g. every rank of a data-parallel restart) is read from disk
            by one of them and sent to the others over the process group
            (``FastPersistReader(process_group=...)`` when ``dcp.load`` is
            given one), inside DCP's read step.  Wins when the disk, not the
            network, is the bottleneck.
        share_interleaved_reads: on load, when ranks need interleaved parts
            of the same stored rows (e.g. a load that changes which dimension
            is sharded: each rank needs a column band of every row, many
            small runs), each range of rows is read once, whole and
            sequentially, by one rank, which sends every other rank its part
            over the process group (``FastPersistReader(process_group=...)``
            must be the group ``dcp.load`` uses).  Each rank reads about the
            bytes it needs, in large requests.  Wins when the per-rank pieces
            are small (under 64 KiB) and the network is faster than the
            disk's small-request rate.  The coordinator decides per stored
            chunk, and only where the ranks' parts cover the rows they span.
            ``None`` (the default, ``auto``): on when the load's process
            group moves tensors on the CPU (gloo, or ``"cpu:gloo,cuda:nccl"``),
            and only for rows whose ranks all run on one machine (their parts
            are copied from memory, never sent over a network that may be
            slower than reading the runs); off for an NCCL-only group.
            ``True`` also shares across machines; ``False`` always reads each
            rank's pieces itself.
        shared_read_transport: how the two ``share_*`` options move a part
            from the rank that read it to a rank that needs it: ``"auto"``
            (a rank on the same machine copies it straight out of the
            reader's memory with ``process_vm_readv``, one kernel copy
            instead of packing, sending and receiving over the process
            group; other pairs, and machines whose kernel refuses it (ptrace
            rules, seccomp), use the process group) or ``"process_group"``
            (always the process group's sends and receives).  Which pairs
            could pull is checked once per load with a probe, so a pid
            namespace or another machine is never read by mistake.
        write_checksums: on save, store the CRC-32C of every 1 MiB block of
            every extent in the metadata, computed by the engine while the
            bytes pass through it (a few percent of save throughput; see
            ``fp_dcp.checksums``).
        verify_checksums: on load, check every checksum block a read covers
            whole against the stored CRC-32C and raise
            ``fp_dcp.checksums.ChecksumError`` (an ``OSError``, ``EIO``)
            naming the tensor, the file and the offset on a mismatch.
            Blocks a resharded read covers only in part are not checked
            (``fp-dcp verify`` checks every block).  Checkpoints written
            without checksums load unchecked.
        freeze_gc_during_save: ``gc.freeze()`` the objects that exist when a
            save starts, until this rank's part of it ends, so the cyclic
            garbage collector does not walk a state dict of thousands of
            tensors again and again while DCP plans and fp_dcp commits (a
            quarter of a 4 GiB save of 9,245 tensors here).  What the save
            allocates is still collected.  Skipped when the process has
            already frozen objects itself; and if anything else freezes
            objects while the save runs (the permanent generation grew past
            what the save froze), nothing is unfrozen at the end, so the
            application's own ``gc.freeze()`` is never undone.  Does nothing on CPython 3.12 (``fp_dcp.gc_freeze``).
        freeze_gc_during_load: the same for a load, from
            ``set_up_storage_reader`` to the end of ``read_data`` (the
            metadata is decoded with the collector paused): a load of
            thousands of tensors otherwise runs a full collection of every
            object of the process each time DCP's and fp_dcp's per-item
            objects pile up (about 0.15 s each here).
        allow_pickle: on load, unpickle the checkpoint's objects (DCP's bytes
            items: non-tensor values such as a step counter or a scheduler's
            state) with the full unpickler, which runs any code the
            checkpoint names.  Off by default: every object is rebuilt by
            torch's restricted unpickler (``torch.load(weights_only=True)``,
            extended by ``torch.serialization.add_safe_globals``), and one
            that needs another type is refused with
            ``fp_dcp.load.objects.UnsafeObjectError`` naming the key and the
            types.  Set it only for checkpoints you trust.
    """

    engine: str = "auto"
    direct_io: bool | None = None
    queue_depth: int | None = None
    block_size_bytes: int | None = None
    alignment_bytes: int | None = None
    pack_threshold_bytes: int = 256 * 1024
    pack_alignment_bytes: int = 64
    sync_files: bool = True
    coalesce_gap_bytes: int = 64 * 1024
    cuda_chunk_bytes: int = 64 << 20
    overwrite: bool = True
    data_dirs: tuple[str, ...] = ()
    split_alignment_bytes: int = 64 * 1024
    staging: str = "eager"
    staging_memory_limit_bytes: int | None = None
    staging_shared_memory: bool | None = None
    staging_spill_dir: str | None = None
    staging_checksums: bool = True
    read_buffer_budget_bytes: int = 128 << 20
    read_threads: int = 1
    max_overread_percent: int = 5
    strict_dtype: bool = False
    share_replicated_reads: bool = False
    share_interleaved_reads: bool | None = None
    shared_read_transport: str = "auto"
    write_checksums: bool = True
    verify_checksums: bool = True
    freeze_gc_during_save: bool = True
    freeze_gc_during_load: bool = True
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        from fp_dcp import _native

        valid = ("auto",) + tuple(_native.ENGINES)
        if self.engine not in valid:
            raise ValueError(
                f"FastPersistOptions.engine={self.engine!r} is not an engine; "
                f"valid: {', '.join(valid)}"
            )
        for name in ("queue_depth", "block_size_bytes", "alignment_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"FastPersistOptions.{name} must be positive, got {value}")
        a = self.alignment_bytes
        if a is not None and a & (a - 1):
            raise ValueError(f"FastPersistOptions.alignment_bytes must be a power of two, got {a}")
        p = self.pack_alignment_bytes
        if p <= 0 or p & (p - 1):
            raise ValueError(f"FastPersistOptions.pack_alignment_bytes must be a power of two, got {p}")
        for name in ("pack_threshold_bytes", "coalesce_gap_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"FastPersistOptions.{name} must be >= 0")
        if self.cuda_chunk_bytes < (1 << 20):
            raise ValueError("FastPersistOptions.cuda_chunk_bytes must be at least 1 MiB")
        if self.staging not in ("eager", "lazy"):
            raise ValueError(f"FastPersistOptions.staging={self.staging!r}; valid: eager, lazy")
        limit = self.staging_memory_limit_bytes
        if limit is not None and limit < (1 << 20):
            raise ValueError(f"FastPersistOptions.staging_memory_limit_bytes must be at least 1 MiB, got {limit}")
        if self.read_buffer_budget_bytes < (1 << 20):
            raise ValueError(
                f"FastPersistOptions.read_buffer_budget_bytes must be at least 1 MiB, got {self.read_buffer_budget_bytes}"
            )
        if self.read_threads < 1:
            raise ValueError(f"FastPersistOptions.read_threads must be at least 1, got {self.read_threads}")
        if self.share_interleaved_reads is not None and not isinstance(self.share_interleaved_reads, bool):
            raise ValueError(
                "FastPersistOptions.share_interleaved_reads must be True, False or None (auto), "
                f"got {self.share_interleaved_reads!r}"
            )
        if self.shared_read_transport not in ("auto", "process_group"):
            raise ValueError(
                f"FastPersistOptions.shared_read_transport={self.shared_read_transport!r}; "
                "valid: auto, process_group"
            )
        if self.max_overread_percent < 0:
            raise ValueError(f"FastPersistOptions.max_overread_percent must be >= 0, got {self.max_overread_percent}")
        self._check_upper_bounds()

    def _check_upper_bounds(self) -> None:
        for name, most in _UPPER.items():
            value = getattr(self, name)
            if value is not None and value > most:
                shown = format_size(most) if name.endswith("_bytes") else f"{most:,}"
                raise OptionBoundError(
                    f"FastPersistOptions.{name}={value:,} is past its upper bound {shown}; "
                    f"lower it (environment {_ENV_PREFIX}{name.upper()})"
                )
        depth = self.queue_depth or _DEFAULT_QUEUE_DEPTH
        block = self.block_size_bytes or _DEFAULT_BLOCK_BYTES
        if depth * block > MAX_IN_FLIGHT_BYTES:
            raise OptionBoundError(
                f"FastPersistOptions queue_depth={depth} x block_size_bytes={format_size(block)} is "
                f"{format_size(depth * block)} of bounce buffers per engine, past the bound of "
                f"{format_size(MAX_IN_FLIGHT_BYTES)}; lower queue_depth or block_size_bytes "
                f"(unset: {_DEFAULT_QUEUE_DEPTH} requests of {format_size(_DEFAULT_BLOCK_BYTES)})"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_env(cls, **kwargs: Any) -> "FastPersistOptions":
        """Options from ``FP_DCP_*`` environment variables, then ``kwargs`` on top."""
        _check_names(kwargs)
        values: dict[str, Any] = {}
        known = set(cls.field_names())
        for key, raw in os.environ.items():
            if not key.startswith(_ENV_PREFIX) or key in _NOT_OPTIONS:
                continue
            name = key[len(_ENV_PREFIX):].lower()
            if name not in known:
                raise ValueError(
                    f"environment variable {key} names no fp_dcp option; valid: "
                    + ", ".join(_ENV_PREFIX + n.upper() for n in sorted(known))
                )
            values[name] = _parse_env(name, raw)
        values.update(kwargs)
        return cls(**values)

    def replace(self, **kwargs: Any) -> "FastPersistOptions":
        _check_names(kwargs)
        return dataclasses.replace(self, **kwargs)


def _check_names(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(FastPersistOptions.field_names()))
    if unknown:
        raise TypeError(
            f"unknown fp_dcp option(s) {', '.join(unknown)}; valid: "
            + ", ".join(FastPersistOptions.field_names())
        )


def _parse_env(name: str, raw: str) -> Any:
    """An environment value for field ``name``, read by the field's declared
    type (not by guessing from its text): ``bool`` (true/false, 1/0, yes/no,
    on/off), ``int`` (sizes with units for ``*_bytes``), else the text.  For a
    field that may be ``None`` (its default "decide for me"), an empty value
    or ``none`` means ``None`` (and ``auto`` too for bool and int fields), so
    ``FP_DCP_STAGING_SPILL_DIR=none`` is no spill directory, not one named
    "none" (write ``./none`` for that)."""
    hint = typing.get_type_hints(FastPersistOptions)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if len(args) == 1 and optional else hint
    text = raw.strip()
    low = text.lower()
    if optional and (low in ("", "none") or (low == "auto" and base in (bool, int))):
        return None
    if base is bool:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{_ENV_PREFIX}{name.upper()}={raw!r}: expected true/false")
    if base is int:
        try:
            return parse_size(text) if name.endswith("_bytes") else int(text)
        except ValueError as e:
            raise ValueError(f"{_ENV_PREFIX}{name.upper()}={raw!r}: {e}") from None
    return text


@contextlib.contextmanager
def override(**kwargs: Any) -> Iterator[None]:
    """Set ``FP_DCP_*`` environment variables for the duration of a block.

    ``with override(engine="threads"): ...`` makes every options object created
    inside the block use the threads engine.  The previous environment is
    restored in ``finally``, also when the block raises.
    """
    _check_names(kwargs)
    saved = {}
    try:
        for name, value in kwargs.items():
            key = _ENV_PREFIX + name.upper()
            saved[key] = os.environ.get(key)
            os.environ[key] = "none" if value is None else str(value)
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
