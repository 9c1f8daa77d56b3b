"""Type stub of fp_dcp._aio, the native extension built from cython_io/
(private to fp_dcp: fp_dcp/_native.py is its only importer). See
docs/NATIVE.md for the engine's semantics."""

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

_Path = str | bytes | os.PathLike[str] | os.PathLike[bytes]
_Ints = Sequence[int] | npt.NDArray[np.int64]

ENGINES: tuple[str, ...]
"""The engine kinds, in the order "auto" tries them: ("aio", "uring", "threads")."""
DEFAULT_QUEUE_DEPTH: int
DEFAULT_KEEP_POOL_BYTES: int
DEFAULT_BLOCK_SIZE: int
DEFAULT_COALESCE_GAP: int

def stats() -> dict[str, int]:
    """Process-wide live counters: buffers, locked_bytes, engines, inflight."""
def kept_pools() -> tuple[int, int]:
    """The bounce buffers kept from closed engines: (count, bytes)."""
def release_kept_pools() -> None:
    """Free the bounce buffers kept from closed engines now."""
def set_keep_limit(size_bytes: int) -> int:
    """The most bytes of closed engines' bounce buffers kept from now on (0: none); returns the one before."""

def page_size() -> int:
    """The kernel's page size in bytes."""

def probe_alignment(path: _Path) -> tuple[int, int]:
    """(memory_alignment, offset_alignment) O_DIRECT needs on the file system holding path."""

def direct_io_supported(directory: _Path) -> bool:
    """Whether files in directory can be opened with O_DIRECT."""

def lock_pages(address: int, size: int, what: str) -> bool:
    """Page-lock size bytes at address (memory the caller mapped); whether it worked (the first failure warns)."""

def crc32c(data: Buffer, seed: int = 0) -> int:
    """The CRC-32C of a contiguous buffer; seed is the CRC of what came before."""

def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of a + b from crc32c(a), crc32c(b) and len(b)."""

def crc32c_blocks(data: Buffer, block_bytes: int) -> npt.NDArray[np.uint32]:
    """The CRC-32C of each block_bytes of data from its start (one 0 for empty data)."""

def crc32c_many(buffers: Sequence[Buffer],
                block_bytes: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64]]:
    """(crcs, first): crc32c_blocks of many buffers, one call (GIL released); buffer i's: crcs[first[i]:first[i+1]]."""

def copy_gather(dst: Buffer, dst_offsets: _Ints, srcs: Sequence[Buffer],
                checksum_block: int = 0) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64]] | None:
    """Copy srcs[i] into dst at dst_offsets[i] (GIL released); with checksum_block, also their block CRCs."""

def copy_scatter(src: Buffer, src_offsets: _Ints, dsts: Sequence[Buffer]) -> None:
    """Fill each dsts[i] from src at src_offsets[i] (GIL released)."""

def pull(pid: int, dst: Buffer, remote: int, starts: _Ints, run_length: int) -> None:
    """Copy runs of process pid's memory at remote + starts[i] into dst back to back (process_vm_readv)."""

def available_engines() -> list[str]:
    """The engines that can be set up on this kernel right now, in ENGINES order."""

class AlignedBuffer:
    """Aligned, page-locked (when allowed), prefaulted memory; a writable 1-D byte buffer."""

    def __init__(self, size_bytes: int, alignment: int = 4096, lock: bool = True,
                 prefault: bool = True) -> None: ...
    @property
    def address(self) -> int:
        """The memory's address (ValueError once closed)."""
    @property
    def size(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def locked(self) -> bool:
        """Whether mlock succeeded."""
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Free the memory now (BufferError while views exist)."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __enter__(self) -> AlignedBuffer: ...
    def __exit__(self, *exc: object) -> None: ...

class Engine:
    """An O_DIRECT I/O engine (kernel AIO, io_uring or threads) with its bounce buffers; one thread at a time."""

    kind: str
    queue_depth: int
    block_size: int
    read_queue_depth: int
    read_block_size: int
    alignment: int
    memory_alignment: int

    def __init__(self, kind: Literal["auto", "aio", "uring", "threads"] = "auto", *,
                 queue_depth: int = 8, block_size: int = 4 << 20, read_queue_depth: int | None = None,
                 read_block_size: int | None = None, alignment: int = 4096, memory_alignment: int | None = None,
                 threads: int = 4) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def busy(self) -> bool:
        """Whether a call runs on this engine now."""
    def settle_pool(self) -> None:
        """Fault the bounce buffers in and lock them now (beside another thread's calls)."""
    def writes_in_place(self, source: Buffer, file_offset: int = 0) -> bool:
        """Whether write() moves source at file_offset straight from its memory, never through a bounce buffer."""
    @property
    def pool_settled(self) -> bool:
        """Whether the bounce buffers are faulted in and locked."""
    def close(self) -> None:
        """Tear the engine down (idempotent)."""
    def open(self, path: _Path, mode: Literal["w", "r"], direct: bool | None = None) -> int:
        """Open path for the engine ("w" or "r"; O_DIRECT per direct); returns an fd."""
    @staticmethod
    def is_direct(fd: int) -> bool:
        """Whether fd was opened with O_DIRECT."""
    def write(self, fds: Sequence[int], paths: Sequence[str], file_index: _Ints, file_offset: _Ints,
              sources: Sequence[Buffer], sync: bool = True, checksums: bool | int = False,
              checksum_origin: _Ints | None = None, on_start: Callable[[], object] | None = None) -> dict[str, Any]:
        """Write sources[i] at file_offset[i] of fds[file_index[i]]; returns stats (and CRCs).
        on_start(): called as the GIL is let go for the I/O."""
    def read(self, fds: Sequence[int], paths: Sequence[str], file_index: _Ints, file_offset: _Ints,
             dests: Sequence[Buffer], coalesce_gap: int = 65536, checksums: bool | int = False,
             checksum_origin: _Ints | None = None,
             checksum_skip: Sequence[bool] | npt.NDArray[np.bool_] | None = None) -> dict[str, Any]:
        """Fill dests[i] from file_offset[i] of fds[file_index[i]]; returns stats (and CRCs)."""
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: object) -> None: ...

# Test hooks: RuntimeError unless the process started with FP_DCP_TEST_HOOKS=1
# (tests reach them through fp_dcp._native.testing()).

def _test_hooks_enabled() -> bool:
    """Whether this process started with FP_DCP_TEST_HOOKS=1."""

def _set_fault(what: Literal["io", "short", "open_direct", "kill", ""], err: int = 0, after: int = 0) -> None:
    """Inject an I/O error, short transfers, O_DIRECT open failures or a kill; "" clears all."""

def _crc32c_impl(which: Literal["hw", "sw"] | None = None) -> Literal["hw", "sw"]:
    """Force (or ask) the CRC-32C implementation, process-wide."""

def _crc_copy_streams(dst: int, src: int, length: int) -> bool:
    """Whether a fused copy + CRC-32C from src to dst would use streaming stores."""

def _crc_nt_bytes() -> int:
    """Bytes copied with streaming stores in this process so far."""
