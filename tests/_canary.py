"""A file outside every root a test hands fp_dcp: it must keep its bytes and
its modification time whatever the test makes fp_dcp do."""

import os


def canary(path) -> tuple[str, bytes, int]:
    """Write the canary at ``path`` with a fixed, old modification time."""
    data = b"canary bytes outside the checkpoint " * 200
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    return str(path), data, os.stat(path).st_mtime_ns


def assert_canary(canary) -> None:
    """The canary is still there, with the same bytes, never written."""
    path, data, mtime = canary
    assert os.path.exists(path), f"{path} was deleted"
    with open(path, "rb") as f:
        assert f.read() == data, f"{path} was changed"
    assert os.stat(path).st_mtime_ns == mtime, f"{path} was written"
