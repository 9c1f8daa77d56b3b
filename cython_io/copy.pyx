# copy.pyx: memory-to-memory copies with the GIL released: gather/scatter of
# many pieces (optionally checksummed in the same pass), pulls from a peer process.
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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
