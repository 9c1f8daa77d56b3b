# engines.pyx: Engine, the O_DIRECT I/O engine (one backend of fpio_engine.h
# with its bounce buffers): files, write(), read().
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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


# The bounce buffers of closed engines, kept (faulted in and page-locked) for
# the next engine of the same shape: a training job that checkpoints through a
# new writer each time would otherwise pay their first touch in every save
# (tens of ms where the host hands guest memory out lazily, and takes freed
# memory back).  At most _keep_limit bytes are kept (set_keep_limit; fp_dcp
# sets it from $FP_DCP_KEEP_BOUNCE_BUFFERS).
DEFAULT_KEEP_POOL_BYTES = 256 << 20
cdef list _kept_pools = []
cdef Py_ssize_t _keep_limit = DEFAULT_KEEP_POOL_BYTES


def set_keep_limit(Py_ssize_t size_bytes):
    """The most bytes of closed engines' bounce buffers kept from now on (0:
    none); those kept past it are freed now.  Returns the limit before."""
    global _keep_limit
    if size_bytes < 0:
        raise ValueError(f"the limit of kept bounce buffers must be >= 0 bytes, got {size_bytes}")
    before = _keep_limit
    _keep_limit = size_bytes
    while _kept_pools and sum((<AlignedBuffer>b)._size for b in _kept_pools) > _keep_limit:
        (<AlignedBuffer>_kept_pools.pop(0))._free()
    return before


cdef AlignedBuffer _take_pool(Py_ssize_t size, Py_ssize_t alignment):
    """A kept pool of this size and alignment (settled), or None."""
    cdef AlignedBuffer b
    for i in range(len(_kept_pools)):
        b = _kept_pools[i]
        if b._size == size and b._alignment == alignment and b._ptr != NULL:
            del _kept_pools[i]
            return b
    return None


cdef bint _keep_pool(AlignedBuffer pool):
    """Keep a settled pool for a later engine, if the limit allows."""
    if pool is None or pool._ptr == NULL or pool._exports:
        return False
    kept = sum((<AlignedBuffer>b)._size for b in _kept_pools)
    if kept + pool._size > _keep_limit:
        return False
    _kept_pools.append(pool)
    return True


def kept_pools():
    """The bounce buffers kept from closed engines: (count, bytes)."""
    return len(_kept_pools), sum((<AlignedBuffer>b)._size for b in _kept_pools)


def release_kept_pools():
    """Free the bounce buffers kept from closed engines now (and their locks)."""
    pools = list(_kept_pools)
    del _kept_pools[:]
    for b in pools:
        (<AlignedBuffer>b)._free()


cdef inline bint _through_slot(const char *ptr, int64_t ln, int64_t off, int64_t bs, int64_t align,
                               int64_t mem_align, bint write) noexcept:
    """Whether a piece on its own goes (in part) through a bounce buffer: one
    whose offset is not aligned, or whose memory is not ``mem_align``-aligned;
    to be written, one that is not whole blocks; to be read, one shorter than
    a block or whose length is not aligned (fpio_pipeline.c's move_piece)."""
    return ln > 0 and ((ln % bs != 0 if write else (ln < bs or ln % align != 0))
                       or off % align != 0 or <uintptr_t>ptr % <uintptr_t>mem_align != 0)


cdef class Engine:
    """An I/O engine with its pool of queue_depth + 1 aligned bounce buffers,
    reused by every call, faulted in and page-locked by the first call that
    needs one (_through_slot). See docs/NATIVE.md."""
    cdef fpio_engine *_e
    cdef readonly str kind
    cdef readonly int queue_depth
    cdef readonly Py_ssize_t block_size
    cdef readonly int read_queue_depth
    cdef readonly Py_ssize_t read_block_size
    cdef readonly Py_ssize_t alignment
    cdef readonly Py_ssize_t memory_alignment
    cdef AlignedBuffer _pool
    cdef char **_slots
    cdef bint _busy
    cdef bint _counted
    cdef bint _pool_settled
    cdef bint _settling  # settle_pool is faulting the pool in, slot by slot, on another thread
    cdef bint _failed  # a call failed: its pool is not kept (requests may have been left in flight)
    # held while the pool is being settled: settle_pool() on another thread
    # runs beside calls, which take each slot as it is faulted in; a call
    # that needs a slot while no settle_pool is at work settles the pool itself
    cdef object _settle_lock

    def __init__(self, str kind="auto", *, int queue_depth=DEFAULT_QUEUE_DEPTH,
                 Py_ssize_t block_size=DEFAULT_BLOCK_SIZE, read_queue_depth=None,
                 read_block_size=None, Py_ssize_t alignment=4096, memory_alignment=None, int threads=4):
        global _n_engines
        if self._slots != NULL:
            raise RuntimeError("Engine.__init__ called twice")
        self._settle_lock = _threading.Lock()
        if kind != "auto" and kind not in _KIND:
            raise ValueError(f"unknown engine {kind!r}: valid are 'auto', "
                             + ", ".join(repr(k) for k in ENGINES))
        if alignment < 512 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {alignment}")
        mem_align = alignment if memory_alignment is None else int(memory_alignment)
        if mem_align < 1 or mem_align & (mem_align - 1) or mem_align > alignment:
            raise ValueError(f"memory_alignment must be a power of two in [1, alignment={alignment}], "
                             f"got {memory_alignment}")
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
        self.memory_alignment = mem_align

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
        self._pool = _take_pool(nslots * slot_size, alignment)
        if self._pool is not None:
            self._pool_settled = True  # kept from a closed engine: faulted in and locked already
        else:
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
        if not self._pool_settled:
            fpio_engine_set_settled(self._e, 0)  # each slot waits for its first touch
        self._counted = True
        _n_engines += 1

    cdef void _settle_pool(self, fpio_piece *pieces, Py_ssize_t n, int64_t bs, int64_t align, int64_t mem_align,
                           bint write):
        """In a call (busy): fault the pool in and lock it when a piece goes
        through a slot (_through_slot)."""
        cdef Py_ssize_t i
        for i in range(n):
            if _through_slot(pieces[i].ptr, pieces[i].len, pieces[i].off, bs, align, mem_align, write):
                self._settle_now(True)
                return

    def writes_in_place(self, source, int64_t file_offset=0):
        """Whether write() moves the bytes of `source` (non-empty) at
        `file_offset` straight from their memory, never through a bounce
        buffer (so never waiting for the buffers to be settled)."""
        cdef Py_buffer view
        PyObject_GetBuffer(source, &view, PyBUF_SIMPLE)
        try:
            return view.len > 0 and not _through_slot(<char *>view.buf, view.len, file_offset, self.block_size,
                                                      self.alignment, self.memory_alignment, True)
        finally:
            PyBuffer_Release(&view)

    cdef void _settle_now(self, bint in_call):
        """Fault the pool in slot by slot, publishing each to the C pipeline
        (a call on another thread uses a slot as soon as it is in), then
        page-lock it. A call finding settle_pool at work leaves it to that."""
        cdef Py_ssize_t slot_size = max(self.block_size, self.read_block_size)
        cdef int nslots = max(self.queue_depth, self.read_queue_depth) + 1
        cdef int i
        if self._pool_settled or (in_call and self._settling):
            return
        with self._settle_lock:  # (waiting for settle_pool on another thread: the GIL is released)
            if self._pool_settled or self._slots == NULL:
                return
            self._settling = not in_call
            try:
                for i in range(nslots):
                    with nogil:
                        memset(self._slots[i], 0, slot_size)
                        fpio_engine_set_settled(self._e, i + 1)
                self._pool._settle(False, True)  # the lock (never a memset now: calls may be using slots)
            finally:
                fpio_engine_set_settled(self._e, nslots)
                self._settling = False
            self._pool_settled = True

    def settle_pool(self):
        """Fault the bounce buffers in and lock them now (otherwise the first
        call that needs one does), e.g. on a thread before the first call.
        A call on another thread meanwhile goes on while it moves aligned
        memory only (those never touch the pool), and takes each bounce
        buffer as soon as it is faulted in; close() waits for it."""
        if self._e == NULL:
            raise ValueError("Engine is closed")
        self._settle_now(False)

    @property
    def pool_settled(self):
        """Whether the bounce buffers are faulted in and locked (a call that
        needs one would not stop to do it)."""
        return bool(self._pool_settled)

    cdef void _free_pool(self) noexcept:
        """Free the pool, or keep it for the next engine when it is settled
        and no call failed; then the slots."""
        cdef bint kept = False
        if self._pool is not None:
            if self._pool_settled and not self._failed:
                try:
                    kept = _keep_pool(self._pool)
                except BaseException:  # noqa: at interpreter shutdown, from __dealloc__
                    pass
            if not kept:
                self._pool._free()
            self._pool = None
        free(self._slots)
        self._slots = NULL

    def close(self):
        """Tear the engine down (idempotent)."""
        if self._busy:
            raise RuntimeError("Engine.close() while a call is running in another thread")
        with self._settle_lock:  # not while settle_pool touches the pool
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
        self._free_pool()  # (kept for the next engine, as by close())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._e == NULL else "open"
        return (f"<Engine {self.kind} {state} qd={self.queue_depth} block={self.block_size} "
                f"read_qd={self.read_queue_depth} read_block={self.read_block_size} "
                f"alignment={self.alignment} memory_alignment={self.memory_alignment}>")

    @property
    def closed(self):
        return self._e == NULL

    @property
    def busy(self):
        """Whether a call (write, read) is running on this engine now."""
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
        writes one, and a checkpoint's data file must not lead out of it.  The
        file is opened non-blocking and must be a regular file (a FIFO or a
        device is refused, never waited on); the fd returned blocks."""
        cdef int flags
        if mode == "w":
            flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK
        elif mode == "r":
            flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK
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
        try:
            if os.fstat(fd).st_mode & 0o170000 != 0o100000:
                raise OSError(EINVAL, "not a regular file (a FIFO, device, socket or directory); fp_dcp "
                              "reads and writes only regular files", os.fsdecode(path))
            os.set_blocking(fd, True)  # io_uring would answer EAGAIN on a non-blocking file
        except BaseException:
            os.close(fd)
            raise
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
              checksum_origin=None, on_start=None):
        """Write sources[i] at file_offset[i] of fds[file_index[i]]. See docs/NATIVE.md.
        checksums=True: stats["crc32c"] holds the CRC-32C of each source; an int
        N: of each N-byte block of each source, blocks counted from byte
        -checksum_origin[i] of source i (default 0: from its start);
        stats["crc32c_first"][i] is the index of source i's first CRC.
        on_start(): called as the GIL is let go for the I/O (the arguments taken)."""
        cdef fpio_result res
        out = {}
        self._run(True, fds, paths, file_index, file_offset, sources, sync, 0, checksums,
                  checksum_origin, out, &res, None, on_start)
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
              int64_t gap, checksums, checksum_origin, dict out, fpio_result *res, checksum_skip=None,
              on_start=None):
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
        cdef int64_t mem_align = self.memory_alignment
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
                self._settle_pool(pieces, n, bs, align, mem_align, write)
            if on_start is not None:
                on_start()
            with nogil:
                if write:
                    rc = fpio_write(self._e, cfds, nfiles, pieces, n, bs, qd, align, mem_align, sync, crcp, res)
                else:
                    rc = fpio_read(self._e, cfds, nfiles, pieces, n, bs, qd, align, mem_align, gap, crcp, res)
            if rc != 0:
                self._failed = True
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
