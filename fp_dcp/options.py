"""Every tunable of fp_dcp (docs/OPTIONS.md).  A field of
:class:`FastPersistOptions` is set by an argument, else by
``FP_DCP_<FIELD NAME IN CAPITALS>`` (sizes accept ``64MiB``), else its
default; an unknown name is an error listing the valid ones."""

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
# FP_DCP_* variables that are not options: FP_DCP_DEFAULT_STORAGE (read by
# fp_dcp/_dcp_hooks.py), FP_DCP_ALLOW_UNTESTED_TORCH (no longer read: a
# leftover one in a job's environment is not refused), FP_DCP_TUNING_FILE
# (the per-user record of `fp-dcp tune`, "none" for no record: fp_dcp/tuning.py),
# FP_DCP_TEST_HOOKS (read by the extension, cython_io/_aio.pyx), FP_DCP_RANKS_PER_NODE
# (the tiers' node size: fp_dcp/tiers/topology.py)
_NOT_OPTIONS = frozenset({"FP_DCP_DEFAULT_STORAGE", "FP_DCP_ALLOW_UNTESTED_TORCH", "FP_DCP_TUNING_FILE",
                          "FP_DCP_TEST_HOOKS", "FP_DCP_RANKS_PER_NODE", "FP_DCP_KEEP_BOUNCE_BUFFERS"})

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
    """A byte count from ``"64MiB"``-style text; an int is returned as is.

    A number (``"1.5GiB"``, not ``".5GiB"``) and an optional case-insensitive
    unit, always binary: ``B``; ``K``/``KB``/``KiB`` 2**10; ``M``/``MB``/``MiB``
    2**20; ``G``... 2**30; ``T``... 2**40.  Fractions are truncated to whole
    bytes.  Anything else is a ``ValueError``."""
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

    Every field, its default, its environment variable and what it does: docs/OPTIONS.md.
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
                "FastPersistOptions.read_buffer_budget_bytes must be at least 1 MiB, "
                f"got {self.read_buffer_budget_bytes}"
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
    """An environment value for field ``name``, read by the field's declared type
    (bool, int with size units for ``*_bytes``, else text); for an optional
    field, empty or ``none`` (and ``auto`` for bool/int) means ``None``."""
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
    """Set ``FP_DCP_*`` environment variables for the duration of a block
    (``with override(engine="threads"): ...``); restored also when it raises."""
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
