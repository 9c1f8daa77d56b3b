# buffers.pyx: AlignedBuffer (aligned, page-locked memory that frees itself),
# and the views of callers' buffers every other part takes.
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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



cdef int _mlock_errno(void *address, size_t size) noexcept nogil:
    """mlock, the one place memory is page-locked: 0 or the errno."""
    if mlock(address, size) != 0:
        return errno
    return 0


cdef void _warn_mlock(int err, Py_ssize_t size, str what):
    """The first failed lock of the process warns; later ones fail the same way."""
    global _mlock_warned
    if _mlock_warned:
        return
    _mlock_warned = True
    warnings.warn(f"fp_dcp: page-locking is off: mlock of {size} bytes ({what}) failed: "
                  f"{os.strerror(err)} (raise `ulimit -l` / RLIMIT_MEMLOCK or grant "
                  f"CAP_IPC_LOCK); buffers stay pageable", RuntimeWarning, stacklevel=3)


def lock_pages(size_t address, Py_ssize_t size, str what):
    """Page-lock `size` bytes at `address` (memory mapped by the caller, e.g. a
    shared memfd arena; AlignedBuffer locks its own); whether it worked.  The
    first failure of the process warns, naming `what`.  The lock ends when the
    memory is unmapped."""
    cdef int rc
    if size <= 0:
        return True
    with nogil:
        rc = _mlock_errno(<void *>address, <size_t>size)
    if rc != 0:
        _warn_mlock(rc, size, what)
    return rc == 0


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
                rc = _mlock_errno(self._ptr, self._size)
            if rc == 0:
                self._locked = True
                _locked_bytes += self._size
            else:
                _warn_mlock(rc, self._size, "an aligned buffer")

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
