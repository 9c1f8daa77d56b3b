# errors.pyx: the one place an errno becomes an exception.
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.

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
