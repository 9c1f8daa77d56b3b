# files.pyx: what the file system under a directory asks of O_DIRECT
# (page size, alignment, whether O_DIRECT opens at all).
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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
