# crc.pyx: CRC-32C of Python buffers (fpio_crc.c underneath).
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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


def crc32c_many(buffers, Py_ssize_t block_bytes):
    """``(crcs, first)``: the CRC-32C of every ``block_bytes`` of each of
    ``buffers`` from its start, as :func:`crc32c_blocks` gives them, in one
    call with the GIL released: buffer i's are ``crcs[first[i]:first[i + 1]]``
    (numpy uint32 and int64; one entry, 0, for an empty buffer)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    bufs = list(buffers)
    cdef Py_ssize_t n = len(bufs), i, j, got = 0, ln
    cdef const char *base
    cdef int64_t[::1] fview
    cdef uint32_t[::1] cview
    cdef Py_buffer *views = <Py_buffer *>calloc(n + 1, sizeof(Py_buffer))
    if views == NULL:
        raise MemoryError()
    try:
        got = _acquire(bufs, views, PyBUF_SIMPLE, "buffers")
        first = np.zeros(n + 1, dtype=np.int64)
        fview = first
        for i in range(n):
            fview[i + 1] = fview[i] + max(1, (views[i].len + block_bytes - 1) // block_bytes)
        crcs = np.zeros(fview[n], dtype=np.uint32)
        if n == 0:
            return crcs, first
        cview = crcs
        with nogil:
            for i in range(n):
                base = <const char *>views[i].buf
                ln = views[i].len
                j = 0
                while j * block_bytes < ln:
                    cview[fview[i] + j] = fpio_crc32c(0, base + j * block_bytes, min(block_bytes, ln - j * block_bytes))
                    j += 1
        return crcs, first
    finally:
        _release_all(views, got)
        free(views)
