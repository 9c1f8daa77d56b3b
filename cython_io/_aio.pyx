# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""fp_dcp._aio: aligned page-locked buffers and an O_DIRECT I/O engine.

Private to fp_dcp. The engines (kernel AIO, io_uring, a pthread pool) and the
write/read pipelines are C (fpio.c); this module holds Python's side of them:
buffers, validation, the GIL, and errors. See docs/NATIVE.md.
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES)
from libc.errno cimport errno, EINVAL, EIO
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset

import array
import os
import warnings

import numpy as np

include "fpio.pxi"

ENGINES = ("aio", "uring", "threads")
cdef dict _KIND = {"aio": FPIO_AIO, "uring": FPIO_URING, "threads": FPIO_THREADS}

# Chosen from the measurements in docs/NATIVE.md (benchmarks/tune_engine.py).
_AUTO_ORDER = ("aio", "uring", "threads")
# The largest file offset a piece may reach (2^62): far past any file system,
# and every sum the pipeline forms from it (rounding up to an alignment, a
# window's end, a checksum origin plus a length) still fits an int64.
cdef int64_t _MAX_FILE_OFFSET = 1 << 62
DEFAULT_QUEUE_DEPTH = 8
DEFAULT_BLOCK_SIZE = 4 << 20
DEFAULT_COALESCE_GAP = 64 * 1024
_MAX_QUEUE_DEPTH = 4096
_MAX_BLOCK_SIZE = 1 << 30
_HUGE_PAGE = 2 << 20

# process-wide counters for leak tests (touched with the GIL held)
cdef Py_ssize_t _n_buffers = 0
cdef Py_ssize_t _locked_bytes = 0
cdef Py_ssize_t _n_engines = 0
cdef bint _mlock_warned = False
cdef int _fault_open_direct = 0


# ---------------------------------------------------------------- errors

cdef object _oserror(int err, str what, object path):
    """The one place an errno becomes an exception: OSError picks the subclass
    (FileNotFoundError, PermissionError, ...) from the errno."""
    msg = os.strerror(err)
    if what:
        msg = f"{msg} ({what})"
    return OSError(err, msg, path)


cdef object _pipeline_error(fpio_result *res, list paths, str kind):
    path = paths[res.file] if res.file >= 0 else None
    if res.eof:
        return OSError(EIO, f"unexpected end of file at offset {res.at} "
                            f"(needed up to {res.need}): file truncated?", path)
    op = res.op.decode()
    if res.len:
        what = f"{op} of {res.len} bytes at offset {res.at}, {kind} engine"
    else:
        what = f"{op}, {kind} engine"
    return _oserror(res.err, what, path)


# ---------------------------------------------------------------- small functions

def page_size():
    """The kernel's page size in bytes."""
    return sysconf(_SC_PAGESIZE)


def probe_alignment(path):
    """(memory_alignment, offset_alignment) for O_DIRECT on the file system
    holding `path` (a file or a directory), from statx(STATX_DIOALIGN); a
    directory is asked through a probe file created and removed in it.
    (4096, 4096) when the kernel or file system gives no answer."""
    cdef uint32_t mem = 0, off = 0
    cdef bytes b = os.fsencode(path)
    cdef int rc = fpio_dioalign(b, &mem, &off)
    if rc < 0:
        raise _oserror(-rc, "statx", path)
    if (mem == 0 or off == 0) and os.path.isdir(path):
        fd, probe = _probe_file(path, 0)
        try:
            rc = fpio_dioalign(os.fsencode(probe), &mem, &off)
        finally:
            os.close(fd)
            os.unlink(probe)
        if rc < 0:
            raise _oserror(-rc, "statx", probe)
    if mem == 0 or off == 0:
        return (4096, 4096)
    return (int(mem), int(off))


cdef tuple _probe_file(directory, int extra_flags):
    """Create a uniquely named empty file in `directory`: (fd, path) or OSError."""
    cdef bytes b
    cdef int fd, err = 0
    cdef int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags
    for _ in range(100):
        probe = os.path.join(directory, f".fp_dcp_probe.{os.getpid()}.{os.urandom(6).hex()}")
        b = os.fsencode(probe)
        if extra_flags & O_DIRECT and _fault_open_direct:
            fd, err = -1, _fault_open_direct
        else:
            fd = c_open(b, flags, 0o600)
            err = errno
        if fd >= 0:
            return fd, probe
        if err == EINVAL and extra_flags & O_DIRECT:
            c_unlink(b)  # O_CREAT may have made the file before O_DIRECT was refused
            break
        if err != 17:  # EEXIST: try another name
            break
    raise _oserror(err, "open", directory)


def direct_io_supported(directory):
    """Whether files in `directory` can be opened with O_DIRECT (EINVAL -> False)."""
    try:
        fd, probe = _probe_file(directory, O_DIRECT)
    except OSError as e:
        if e.errno == EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(probe)
    return True


cdef const int64_t[::1] _i64(obj, str name) except *:
    """A contiguous int64 view of a sequence (numpy int64 arrays without a copy)."""
    cdef const int64_t[::1] v
    try:
        v = obj
    except (ValueError, TypeError, BufferError):
        try:
            v = array.array("q", obj)
        except (TypeError, OverflowError) as e:
            raise TypeError(f"{name} must be a sequence of integers: {e}") from None
    return v


cdef Py_ssize_t _acquire(list objs, Py_buffer *views, int flags, str name) except -1:
    """Get a buffer on every object; on failure release what was taken and raise."""
    cdef Py_ssize_t i = 0
    try:
        for i in range(len(objs)):
            PyObject_GetBuffer(objs[i], &views[i], flags)
    except BaseException as e:
        for j in range(i):
            PyBuffer_Release(&views[j])
        raise type(e)(f"{name}[{i}]: {e}") from e
    return len(objs)


cdef void _release_all(Py_buffer *views, Py_ssize_t n):
    for i in range(n):
        PyBuffer_Release(&views[i])


cdef _copy_pieces(object one, offsets, many, bint gather, Py_ssize_t block=0):
    """gather: many[i] -> one at offsets[i]; scatter: one at offsets[i] -> many[i].
    block > 0: also the CRC-32C of every block of every piece, from its start
    (returns (crcs, first): piece i's are crcs[first[i]:first[i + 1]])."""
    many = list(many)
    cdef Py_buffer big
    cdef Py_ssize_t n = len(many), i, got = 0
    cdef int64_t stop
    cdef const int64_t[::1] offs = _i64(offsets, "offsets")
    if offs.shape[0] != n:
        raise ValueError(f"{n} buffers but {offs.shape[0]} offsets")
    PyObject_GetBuffer(one, &big, PyBUF_WRITABLE if gather else PyBUF_SIMPLE)
    cdef Py_buffer *views = <Py_buffer *>calloc(n + 1, sizeof(Py_buffer))
    cdef char **dst = <char **>malloc((n + 1) * sizeof(char *))
    cdef char **src = <char **>malloc((n + 1) * sizeof(char *))
    cdef int64_t *lens = <int64_t *>malloc((n + 1) * sizeof(int64_t))
    cdef int64_t[::1] fview
    cdef uint32_t[::1] cview
    try:
        if views == NULL or dst == NULL or src == NULL or lens == NULL:
            raise MemoryError()
        got = _acquire(many, views, PyBUF_SIMPLE if gather else PyBUF_WRITABLE,
                       "srcs" if gather else "dsts")
        for i in range(n):
            if offs[i] < 0 or fpio_add_i64(offs[i], views[i].len, &stop) < 0 or stop > big.len:
                raise ValueError(f"piece {i}: {views[i].len} bytes at offset {offs[i]} are outside "
                                 f"the {big.len}-byte buffer")
            lens[i] = views[i].len
            if gather:
                dst[i] = <char *>big.buf + offs[i]
                src[i] = <char *>views[i].buf
            else:
                dst[i] = <char *>views[i].buf
                src[i] = <char *>big.buf + offs[i]
        if block <= 0:
            with nogil:
                fpio_copy_many(dst, src, lens, n)
            return None
        first = np.zeros(n + 1, dtype=np.int64)
        for i in range(n):
            first[i + 1] = first[i] + max(1, (lens[i] + block - 1) // block)
        crcs = np.zeros(first[n], dtype=np.uint32)
        if n == 0:
            return crcs, first
        fview = first
        cview = crcs
        with nogil:
            fpio_copy_crc_many(dst, src, lens, n, block, &fview[0], &cview[0])
        return crcs, first
    finally:
        _release_all(views, got)
        PyBuffer_Release(&big)
        free(views)
        free(dst)
        free(src)
        free(lens)


def copy_gather(dst, dst_offsets, srcs, Py_ssize_t checksum_block=0):
    """Copy srcs[i] into the writable buffer dst at dst_offsets[i] (memcpy, GIL
    released).  With ``checksum_block`` > 0 the copy also computes, in the same
    pass over memory, the CRC-32C of every ``checksum_block`` bytes of each
    source from its start, and returns ``(crcs, first)`` (numpy uint32 and
    int64): source i's are ``crcs[first[i]:first[i + 1]]``, the last block
    shorter, one entry 0 for an empty source (as ``crc32c_blocks``)."""
    if checksum_block < 0:
        raise ValueError(f"checksum_block must be >= 0, got {checksum_block}")
    return _copy_pieces(dst, dst_offsets, srcs, True, checksum_block)


def copy_scatter(src, src_offsets, dsts):
    """Fill each writable dsts[i] from src at src_offsets[i] (memcpy, GIL released)."""
    _copy_pieces(src, src_offsets, dsts, False)


def pull(int pid, dst, uint64_t remote, starts, int64_t run_length):
    """Copy ``len(starts)`` runs of ``run_length`` bytes of process ``pid``'s
    memory, at ``remote + starts[i]``, into the writable buffer ``dst`` back to
    back (``process_vm_readv``, GIL released).  The caller guarantees that
    those addresses hold what it wants there: the kernel checks only that they
    are mapped (OSError EFAULT otherwise) and that this process may read
    ``pid``'s memory (EPERM / ESRCH otherwise: ptrace rules, seccomp)."""
    cdef const int64_t[::1] st = _i64(starts, "starts")
    cdef Py_ssize_t n = st.shape[0]
    cdef Py_buffer view
    cdef int rc = 0
    cdef int64_t total
    if run_length < 0:
        raise ValueError(f"run_length must be >= 0, got {run_length}")
    PyObject_GetBuffer(dst, &view, PyBUF_WRITABLE)
    try:
        if fpio_mul_i64(n, run_length, &total) < 0 or total > view.len:
            raise ValueError(f"{n} runs of {run_length} bytes do not fit the {view.len}-byte buffer")
        if n and run_length:
            with nogil:
                rc = fpio_pull(pid, <char *>view.buf, remote, &st[0], n, run_length)
        if rc < 0:
            raise _oserror(-rc, f"process_vm_readv of {n} runs of {run_length} bytes from pid {pid}", None)
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- checksums

# buffers at least this long are checksummed with the GIL released
cdef Py_ssize_t _CRC_NOGIL_BYTES = 64 * 1024


def crc32c(data, unsigned int seed=0):
    """The CRC-32C (Castagnoli, as iSCSI/ext4/RocksDB) of a contiguous buffer.
    ``seed`` is the CRC of what came before (as ``zlib.crc32``): ``crc32c(b,
    crc32c(a)) == crc32c(a + b)``. SSE4.2 instruction where the CPU has it."""
    cdef Py_buffer view
    cdef uint32_t out
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= _CRC_NOGIL_BYTES:
            with nogil:
                out = fpio_crc32c(seed, view.buf, view.len)
        else:
            out = fpio_crc32c(seed, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return out


def crc32c_combine(unsigned int crc1, unsigned int crc2, uint64_t len2):
    """The CRC-32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    return fpio_crc32c_combine(crc1, crc2, len2)


def crc32c_blocks(data, Py_ssize_t block_bytes):
    """numpy uint32 array: the CRC-32C of each ``block_bytes`` of ``data``
    from its start (the last block shorter; one entry, 0, for empty data)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    cdef Py_ssize_t n = view.len, nb = max(1, (n + block_bytes - 1) // block_bytes), i
    out = np.zeros(nb, dtype=np.uint32)
    cdef uint32_t[::1] o = out
    cdef const char *base = <const char *>view.buf
    try:
        with nogil:
            for i in range(nb):
                if n:
                    o[i] = fpio_crc32c(0, base + i * block_bytes, min(block_bytes, n - i * block_bytes))
    finally:
        PyBuffer_Release(&view)
    return out


def _crc32c_impl(which=None):
    """Tests: "hw" or "sw" forces the CRC implementation (process-wide); returns
    the one in use ("sw" where the CPU has no SSE4.2)."""
    if which not in (None, "hw", "sw"):
        raise ValueError(f"which must be None, 'hw' or 'sw', got {which!r}")
    return "hw" if fpio_crc32c_impl(-1 if which is None else (1 if which == "hw" else 0)) else "sw"


def _crc_copy_streams(uintptr_t dst, uintptr_t src, size_t length):
    """Tests: whether a fused copy + CRC-32C of ``length`` bytes from address
    ``src`` to address ``dst`` uses streaming (non-temporal) stores; and
    :func:`_crc_nt_bytes`, the bytes so copied in this process so far."""
    return bool(fpio_crc_copy_streams(dst, src, length))


def _crc_nt_bytes():
    return fpio_crc_nt_bytes()


def stats():
    """Process-wide live counters: buffers, locked_bytes, engines, inflight."""
    return {"buffers": _n_buffers, "locked_bytes": _locked_bytes,
            "engines": _n_engines, "inflight": fpio_inflight()}


def _set_fault(str what, int err=0, long after=0):
    """Fault injection for tests. what="io": the completion after `after`
    successful ones reports -err; what="short": the next `after` completions
    report half their bytes (short transfers); what="open_direct": every open
    with O_DIRECT fails with err (err=0 clears); what="kill": after `after`
    completions the process sends itself signal `err` (a crash mid-save;
    err=0 clears). what="" clears them all."""
    global _fault_open_direct
    if what == "io":
        fpio_fault_set(err, after)
    elif what == "short":
        fpio_fault_short(after)
    elif what == "open_direct":
        _fault_open_direct = err
    elif what == "kill":
        fpio_fault_kill(err, after)
    elif what == "":
        fpio_fault_set(0, 0)
        fpio_fault_short(0)
        fpio_fault_kill(0, 0)
        _fault_open_direct = 0
    else:
        raise ValueError(f"unknown fault {what!r}: valid are 'io', 'short', 'open_direct', 'kill', ''")


# ---------------------------------------------------------------- AlignedBuffer

cdef void _warn_mlock(int err, Py_ssize_t size):
    global _mlock_warned
    if _mlock_warned:
        return
    _mlock_warned = True
    warnings.warn(f"fp_dcp: page-locking is off: mlock of {size} bytes failed: "
                  f"{os.strerror(err)} (raise `ulimit -l` / RLIMIT_MEMLOCK or grant "
                  f"CAP_IPC_LOCK); buffers stay pageable", RuntimeWarning, stacklevel=3)


cdef class AlignedBuffer:
    """`size_bytes` of memory aligned to `alignment`, page-locked (mlock) when
    the process may, prefaulted with the GIL released. A writable 1-D
    unsigned-byte buffer: numpy.frombuffer/torch.frombuffer/memoryview view it
    without copying. close() frees it now (refused while views exist)."""
    cdef char *_ptr
    cdef Py_ssize_t _size
    cdef size_t _alloc
    cdef Py_ssize_t _alignment
    cdef bint _locked
    cdef bint _closed
    cdef int _exports
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __cinit__(self, Py_ssize_t size_bytes, Py_ssize_t alignment=4096, bint lock=True,
                  bint prefault=True):
        global _n_buffers, _locked_bytes
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        if alignment < <Py_ssize_t>sizeof(void *) or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {sizeof(void *)}, got {alignment}")
        cdef void *p = NULL
        cdef size_t alloc = size_bytes if size_bytes > 0 else 1
        cdef size_t place = alignment
        cdef bint huge = size_bytes >= _HUGE_PAGE
        if huge:
            # whole transparent huge pages: fewer faults to prefault, and far fewer
            # pages for the kernel to pin per O_DIRECT request
            place = max(alignment, _HUGE_PAGE)
            alloc = (alloc + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        cdef int rc = posix_memalign(&p, place, alloc)
        if rc != 0:  # a positive errno, not -1
            raise MemoryError(f"posix_memalign({alignment}, {size_bytes}): {os.strerror(rc)}")
        self._ptr = <char *>p
        self._size = size_bytes
        self._alloc = alloc
        self._alignment = alignment
        self._shape[0] = size_bytes
        self._strides[0] = 1
        _n_buffers += 1
        if huge:
            madvise(p, alloc, MADV_HUGEPAGE)  # advisory: no error if THP is off
        self._settle(prefault, lock)

    cdef void _settle(self, bint prefault, bint lock):
        """Fault the memory in (whole, as allocated) and page-lock it."""
        global _locked_bytes
        cdef int rc
        if prefault:
            with nogil:
                memset(self._ptr, 0, self._alloc)
        if lock and self._size > 0 and not self._locked:
            with nogil:
                rc = mlock(self._ptr, self._size)
                if rc != 0:
                    rc = errno
            if rc == 0:
                self._locked = True
                _locked_bytes += self._size
            else:
                _warn_mlock(rc, self._size)

    cdef void _free(self) noexcept:
        global _n_buffers, _locked_bytes
        if self._ptr == NULL:
            return
        if self._locked:
            munlock(self._ptr, self._size)
            _locked_bytes -= self._size
            self._locked = False
        free(self._ptr)
        self._ptr = NULL
        self._closed = True
        _n_buffers -= 1

    def __dealloc__(self):
        self._free()

    cdef char *_check(self) except NULL:
        if self._ptr == NULL:
            raise ValueError("AlignedBuffer is closed")
        return self._ptr

    def close(self):
        """Free the memory now; views must be released first (BufferError)."""
        if self._exports > 0:
            raise BufferError(f"AlignedBuffer has {self._exports} exported view(s); "
                              f"release them before close()")
        self._free()

    @property
    def address(self):
        return <uintptr_t>self._check()

    @property
    def size(self):
        return self._size

    @property
    def alignment(self):
        return self._alignment

    @property
    def locked(self):
        return self._locked

    @property
    def closed(self):
        return self._ptr == NULL

    def __len__(self):
        return self._size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._ptr == NULL:
            return "<AlignedBuffer closed>"
        return (f"<AlignedBuffer size={self._size} alignment={self._alignment} "
                f"locked={bool(self._locked)} at {<uintptr_t>self._ptr:#x}>")

    def __getbuffer__(self, Py_buffer *buf, int flags):
        buf.buf = self._check()
        buf.obj = self
        buf.len = self._size
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = NULL
        if flags & PyBUF_FORMAT:
            buf.format = b"B"
        buf.ndim = 1
        buf.shape = self._shape if flags & PyBUF_ND else NULL
        buf.strides = self._strides if flags & PyBUF_STRIDES == PyBUF_STRIDES else NULL
        buf.suboffsets = NULL
        buf.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *buf):
        self._exports -= 1


# ---------------------------------------------------------------- engines

cdef object _try_engine(int kind, int qd, int nthreads, char **slots, int nslots,
                     int64_t slot_size, fpio_engine **out):
    """Set an engine up: None, or (errno, the refused call) when the kernel refuses it."""
    cdef const char *cwhy = NULL
    cdef int rc
    with nogil:
        rc = fpio_engine_open(kind, qd, nthreads, slots, nslots, slot_size, out, &cwhy)
    if rc < 0:
        return (-rc, cwhy.decode())
    return None


def available_engines():
    """The engines that can be set up on this kernel right now, in ENGINES order."""
    cdef fpio_engine *e = NULL
    out = []
    for name in ENGINES:
        if _try_engine(_KIND[name], 1, 1, NULL, 2, 0, &e) is None:
            fpio_engine_close(e)
            out.append(name)
    return out


cdef class Engine:
    """An I/O engine with its pool of queue_depth + 1 aligned bounce buffers,
    reused by every call, faulted in and page-locked by the first call that
    needs one (a piece whose memory, offset or length is not aligned, or that
    is shorter than a block). See docs/NATIVE.md."""
    cdef fpio_engine *_e
    cdef readonly str kind
    cdef readonly int queue_depth
    cdef readonly Py_ssize_t block_size
    cdef readonly int read_queue_depth
    cdef readonly Py_ssize_t read_block_size
    cdef readonly Py_ssize_t alignment
    cdef AlignedBuffer _pool
    cdef char **_slots
    cdef bint _busy
    cdef bint _counted
    cdef bint _pool_settled

    def __init__(self, str kind="auto", *, int queue_depth=DEFAULT_QUEUE_DEPTH,
                 Py_ssize_t block_size=DEFAULT_BLOCK_SIZE, read_queue_depth=None,
                 read_block_size=None, Py_ssize_t alignment=4096, int threads=4):
        global _n_engines
        if self._slots != NULL:
            raise RuntimeError("Engine.__init__ called twice")
        if kind != "auto" and kind not in _KIND:
            raise ValueError(f"unknown engine {kind!r}: valid are 'auto', "
                             + ", ".join(repr(k) for k in ENGINES))
        if alignment < 512 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {alignment}")
        rqd = queue_depth if read_queue_depth is None else int(read_queue_depth)
        rbs = block_size if read_block_size is None else int(read_block_size)
        for name, qd in (("queue_depth", queue_depth), ("read_queue_depth", rqd)):
            if not 1 <= qd <= _MAX_QUEUE_DEPTH:
                raise ValueError(f"{name} must be in [1, {_MAX_QUEUE_DEPTH}], got {qd}")
        for name, bs in (("block_size", block_size), ("read_block_size", rbs)):
            if bs <= 0 or bs % alignment or bs > _MAX_BLOCK_SIZE:
                raise ValueError(f"{name} must be a positive multiple of alignment "
                                 f"({alignment}) up to {_MAX_BLOCK_SIZE}, got {bs}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self.read_queue_depth = rqd
        self.read_block_size = rbs
        self.alignment = alignment

        cdef int qd_max = max(queue_depth, rqd)
        cdef Py_ssize_t slot_size = max(block_size, rbs)
        cdef int nslots = qd_max + 1
        self._slots = <char **>calloc(nslots, sizeof(char *))
        if self._slots == NULL:
            raise MemoryError()
        # the bounce buffers: one allocation, carved in slots (whole huge pages
        # for all), faulted in and page-locked by the first call that needs a
        # slot (_settle_pool): reads and writes of aligned memory never do, and
        # first touches are slow where the host hands memory out lazily
        self._pool = AlignedBuffer(nslots * slot_size, alignment, lock=False, prefault=False)
        cdef char *base = self._pool._ptr
        cdef int i
        for i in range(nslots):
            self._slots[i] = base + i * slot_size

        for name in (_AUTO_ORDER if kind == "auto" else (kind,)):
            why = _try_engine(_KIND[name], qd_max, threads, self._slots, nslots, slot_size,
                              &self._e)
            if why is None:
                self.kind = name
                break
        if self._e == NULL:
            self._free_pool()
            err, call = why
            raise _oserror(err, f"{name} engine refused by the kernel: {call} failed"
                           + ("; kernel.io_uring_disabled or a seccomp filter?" if name == "uring" else ""),
                           None)
        self._counted = True
        _n_engines += 1

    cdef void _settle_pool(self, fpio_piece *pieces, Py_ssize_t n, int64_t bs, int64_t align):
        """In a call (busy): fault the pool in and lock it when a piece goes
        through a slot: one shorter than a block, or whose memory, offset or
        length is not aligned (fpio.c's direct_body takes the aligned rest
        in place)."""
        cdef Py_ssize_t i
        for i in range(n):
            if pieces[i].len > 0 and (pieces[i].len < bs or pieces[i].len % align or pieces[i].off % align
                                      or <uintptr_t>pieces[i].ptr % <uintptr_t>align):
                self._settle_now()
                return

    cdef void _settle_now(self):
        if not self._pool_settled:
            self._pool._settle(True, True)
            self._pool_settled = True

    def settle_pool(self):
        """Fault the bounce buffers in and lock them now (otherwise the first
        call that needs one does), e.g. on a thread before the first call.
        Refused, like a call, while another thread's call runs."""
        self._enter()
        try:
            self._settle_now()
        finally:
            self._busy = False

    cdef void _free_pool(self) noexcept:
        if self._pool is not None:
            self._pool._free()
        free(self._slots)
        self._slots = NULL

    def close(self):
        """Tear the engine down (idempotent)."""
        if self._busy:
            raise RuntimeError("Engine.close() while a call is running in another thread")
        self._close()

    cdef void _close(self) noexcept:
        global _n_engines
        if self._e != NULL:
            with nogil:
                fpio_engine_close(self._e)
            self._e = NULL
        self._free_pool()
        if self._counted:
            self._counted = False
            _n_engines -= 1

    def __dealloc__(self):
        global _n_engines
        if self._e != NULL:
            fpio_engine_close(self._e)
            self._e = NULL
        if self._counted:
            self._counted = False
            _n_engines -= 1
        # the pool's AlignedBuffer frees itself
        free(self._slots)
        self._slots = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._e == NULL else "open"
        return (f"<Engine {self.kind} {state} qd={self.queue_depth} block={self.block_size} "
                f"read_qd={self.read_queue_depth} read_block={self.read_block_size} "
                f"alignment={self.alignment}>")

    @property
    def closed(self):
        return self._e == NULL

    @property
    def busy(self):
        """Whether a call (write, read, settle_pool) is running on this engine now."""
        return bool(self._busy)

    cdef _enter(self):
        if self._e == NULL:
            raise ValueError("Engine is closed")
        if self._busy:
            raise RuntimeError("Engine is in use by another thread: use one engine per thread")
        self._busy = True

    # -------------------------------------------------- files

    def open(self, path, str mode, direct=None):
        """Open `path` for the engine: mode "w" (create/truncate, 0o644) or "r".
        direct=None tries O_DIRECT and falls back to buffered on EINVAL;
        True requires it; False never asks. Returns an fd (close it with os.close).
        A symbolic link as the last component is refused (ELOOP): fp_dcp never
        writes one, and a checkpoint's data file must not lead out of it."""
        cdef int flags
        if mode == "w":
            flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW
        elif mode == "r":
            flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW
        else:
            raise ValueError(f"mode must be 'w' or 'r', got {mode!r}")
        cdef bytes b = os.fsencode(path)
        cdef const char *cpath = b
        cdef int fd = -1, err = 0
        if direct is None or direct:
            if _fault_open_direct:
                err = _fault_open_direct
            else:
                with nogil:
                    fd = c_open(cpath, flags | O_DIRECT, 0o644)
                    if fd < 0:
                        err = errno
            if fd < 0 and err == EINVAL and direct is None:
                err = 0
        if fd < 0 and err == 0:
            with nogil:
                fd = c_open(cpath, flags, 0o644)
                if fd < 0:
                    err = errno
        if fd < 0:
            raise _oserror(err, "open" + (" with O_DIRECT" if direct else ""), path)
        return fd

    @staticmethod
    def is_direct(int fd):
        """Whether fd was opened with O_DIRECT."""
        cdef int fl = fcntl(fd, F_GETFL)
        if fl < 0:
            raise _oserror(errno, f"fcntl(F_GETFL) on fd {fd}", None)
        return bool(fl & O_DIRECT)

    # -------------------------------------------------- I/O

    def write(self, fds, paths, file_index, file_offset, sources, bint sync=True, checksums=False,
              checksum_origin=None):
        """Write sources[i] at file_offset[i] of fds[file_index[i]]. See docs/NATIVE.md.
        checksums=True: stats["crc32c"] holds the CRC-32C of each source; an int
        N: of each N-byte block of each source, blocks counted from byte
        -checksum_origin[i] of source i (default 0: from its start);
        stats["crc32c_first"][i] is the index of source i's first CRC."""
        cdef fpio_result res
        out = {}
        self._run(True, fds, paths, file_index, file_offset, sources, sync, 0, checksums,
                  checksum_origin, out, &res)
        stats = {"bytes": res.bytes, "bytes_on_disk": res.bytes_io, "requests": res.requests,
                 "zero_copy_bytes": res.zc_bytes, "checksum_bytes": res.crc_bytes, "seconds": res.seconds}
        stats.update(out)
        return stats

    def read(self, fds, paths, file_index, file_offset, dests,
             Py_ssize_t coalesce_gap=DEFAULT_COALESCE_GAP, checksums=False, checksum_origin=None,
             checksum_skip=None):
        """Fill dests[i] from file_offset[i] of fds[file_index[i]]. See docs/NATIVE.md.
        checksums as for write(), of what landed in each dest; checksum_skip
        (with a block size): a bool per dest, True = no checksum for it (one
        entry, 0; its bytes are not fed to the CRC)."""
        cdef fpio_result res
        if coalesce_gap < 0:
            raise ValueError(f"coalesce_gap must be >= 0, got {coalesce_gap}")
        out = {}
        self._run(False, fds, paths, file_index, file_offset, dests, False, coalesce_gap, checksums,
                  checksum_origin, out, &res, checksum_skip)
        stats = {"bytes": res.bytes, "bytes_read": res.bytes_io, "requests": res.requests,
                 "direct_bytes": res.zc_bytes, "checksum_bytes": res.crc_bytes, "seconds": res.seconds}
        stats.update(out)
        return stats

    cdef _run(self, bint write, fds, paths, file_index, file_offset, bufs, bint sync,
              int64_t gap, checksums, checksum_origin, dict out, fpio_result *res, checksum_skip=None):
        bufs = list(bufs)
        cdef Py_ssize_t n = len(bufs), nfiles = len(fds), i, got = 0
        cdef const int64_t[::1] fi = _i64(file_index, "file_index")
        cdef const int64_t[::1] fo = _i64(file_offset, "file_offset")
        paths = list(paths)
        if fi.shape[0] != n or fo.shape[0] != n:
            raise ValueError(f"{n} buffers but {fi.shape[0]} file_index and "
                             f"{fo.shape[0]} file_offset entries")
        if len(paths) != nfiles:
            raise ValueError(f"{nfiles} fds but {len(paths)} paths")
        cdef int *cfds = NULL
        cdef Py_buffer *views = NULL
        cdef fpio_piece *pieces = NULL
        cdef int64_t f, o, ln, stop, pf = -1, po = 0, end = 0
        cdef int64_t bs = self.block_size if write else self.read_block_size
        cdef int qd = self.queue_depth if write else self.read_queue_depth
        cdef int64_t align = self.alignment
        cdef int rc
        cdef int64_t crc_block = 0
        cdef fpio_crc crc
        cdef fpio_crc *crcp = NULL
        cdef int64_t[::1] crc_first
        cdef uint32_t[::1] crc_out
        cdef const int64_t[::1] crc_org
        cdef const uint8_t[::1] crc_skip
        cdef int64_t org
        if checksums is True:
            crcp = &crc
        elif checksums is not False and checksums is not None:
            if isinstance(checksums, bool) or not isinstance(checksums, int) or not 0 < checksums <= _MAX_BLOCK_SIZE:
                raise ValueError(f"checksums must be False, True or a block size in bytes in "
                                 f"[1, {_MAX_BLOCK_SIZE}], got {checksums!r}")
            crc_block = checksums
            crcp = &crc
        crc.origin = NULL
        if checksum_origin is not None:
            if crc_block == 0:
                raise ValueError("checksum_origin needs checksums=<block size>")
            crc_org = _i64(checksum_origin, "checksum_origin")
            if crc_org.shape[0] != n:
                raise ValueError(f"{n} buffers but {crc_org.shape[0]} checksum_origin entries")
            for i in range(n):
                if not 0 <= crc_org[i] <= _MAX_FILE_OFFSET:
                    raise ValueError(f"piece {i}: checksum_origin {crc_org[i]} is negative or beyond the largest file offset")
            if n:
                crc.origin = &crc_org[0]
        crc.skip = NULL
        if checksum_skip is not None:
            if crc_block == 0:
                raise ValueError("checksum_skip needs checksums=<block size>")
            skip_arr = np.ascontiguousarray(checksum_skip, dtype=np.bool_).view(np.uint8)
            if skip_arr.ndim != 1 or skip_arr.shape[0] != n:
                raise ValueError(f"{n} buffers but {skip_arr.size} checksum_skip entries")
            crc_skip = skip_arr
            if n:
                crc.skip = &crc_skip[0]
        self._enter()
        try:
            cfds = <int *>malloc((nfiles + 1) * sizeof(int))
            views = <Py_buffer *>calloc(n + 1, sizeof(Py_buffer))
            pieces = <fpio_piece *>malloc((n + 1) * sizeof(fpio_piece))
            if cfds == NULL or views == NULL or pieces == NULL:
                raise MemoryError()
            for i in range(nfiles):
                cfds[i] = fds[i]
            got = _acquire(bufs, views, PyBUF_SIMPLE if write else PyBUF_WRITABLE,
                           "sources" if write else "dests")
            for i in range(n):
                f = fi[i]
                o = fo[i]
                ln = views[i].len
                if f < 0 or f >= nfiles:
                    raise ValueError(f"piece {i}: file_index {f} is not in [0, {nfiles})")
                if o < 0:
                    raise ValueError(f"piece {i}: file_offset {o} is negative")
                if fpio_add_i64(o, ln, &stop) < 0 or stop > _MAX_FILE_OFFSET:
                    raise ValueError(f"piece {i}: file_offset {o} + length {ln} is beyond the "
                                     f"largest file offset ({_MAX_FILE_OFFSET})")
                if f < pf or (f == pf and o < po):
                    raise ValueError(f"piece {i}: pieces must be sorted by (file_index, "
                                     f"file_offset); ({f}, {o}) follows ({pf}, {po})")
                if f != pf:
                    end = 0
                if write and ln > 0 and o < end:
                    raise ValueError(f"piece {i}: [{o}, {o + ln}) of file {f} overlaps an "
                                     f"earlier piece ending at {end}")
                if o + ln > end:
                    end = o + ln
                pf = f
                po = o
                pieces[i].ptr = <char *>views[i].buf
                pieces[i].len = ln
                pieces[i].off = o
                pieces[i].file = <int32_t>f
            if crcp != NULL:
                first = np.empty(n + 1, dtype=np.int64)
                crc_first = first
                crc_first[0] = 0
                for i in range(n):
                    ln = pieces[i].len
                    org = crc.origin[i] if crc.origin != NULL else 0
                    crc_first[i + 1] = crc_first[i] + (
                        1 if crc_block == 0 or ln == 0 or (crc.skip != NULL and crc.skip[i])
                        else (org + ln - 1) // crc_block - org // crc_block + 1)
                crcs = np.zeros(crc_first[n], dtype=np.uint32)
                crc_out = crcs
                crc.block = crc_block
                crc.first = &crc_first[0]
                crc.out = &crc_out[0] if crc_first[n] > 0 else NULL
            if not self._pool_settled:
                self._settle_pool(pieces, n, bs, align)
            with nogil:
                if write:
                    rc = fpio_write(self._e, cfds, nfiles, pieces, n, bs, qd, align, sync, crcp, res)
                else:
                    rc = fpio_read(self._e, cfds, nfiles, pieces, n, bs, qd, align, gap, crcp, res)
            if rc != 0:
                raise _pipeline_error(res, paths, self.kind)
            if crcp != NULL:
                out["crc32c"] = crcs
                if crc_block:
                    out["crc32c_first"] = first
        finally:
            self._busy = False
            _release_all(views, got)
            free(cfds)
            free(views)
            free(pieces)
