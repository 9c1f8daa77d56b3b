"""The per-user record of ``fp-dcp tune`` per block device, in
``$FP_DCP_TUNING_FILE`` (``none``: off), else
``$XDG_CACHE_HOME/fp_dcp/tuning.json``; a record that does not fit is ignored
with one warning (tuning never stops a save or a load)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import threading
import warnings
from typing import Any, NamedTuple

from fp_dcp import files

__all__ = ["Shape", "Tuned", "TuningWarning", "block_device", "device_identity", "lookup", "record_path", "store"]

ENV = "FP_DCP_TUNING_FILE"
FORMAT = "fp_dcp tuning"
VERSION = 1
# a record's shapes are used only within these bounds (a file edited by hand,
# or written by a newer fp_dcp, must not allocate gigabytes of bounce buffers)
MAX_BLOCK_BYTES = 64 << 20
MAX_QUEUE_DEPTH = 1024
MAX_IN_FLIGHT_BYTES = 256 << 20  # = fp_dcp.options.MAX_IN_FLIGHT_BYTES, the bound of the options
# the largest record file read (a record is some hundred bytes per device);
# it must be a regular file, not a link (a FIFO would hang every save)
MAX_RECORD_FILE_BYTES = 1 << 20

# where sysfs links "major:minor" to each block device's directory
_SYS_DEV_BLOCK = "/sys/dev/block"
# sysfs files that name a disk, relative to /sys/block/<disk>/
_IDENTITY = (("model", "device/model"), ("vendor", "device/vendor"), ("serial", "serial"),
             ("serial", "device/serial"), ("wwid", "wwid"), ("wwid", "device/wwid"))


class TuningWarning(UserWarning):
    """A tuning record that is ignored (the built-in rule applies)."""


class Shape(NamedTuple):
    block_size: int
    queue_depth: int


class Tuned(NamedTuple):
    """The shapes a record chose for a device."""

    write: Shape
    read: Shape


def record_path() -> str | None:
    """The record file, or None when ``FP_DCP_TUNING_FILE`` is ``none`` (or empty)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "none") else os.path.expanduser(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fp_dcp", "tuning.json")


def read_sysfs(path: str) -> str | None:
    """A sysfs file's text, stripped; None where it does not read or is empty."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def block_device(directory: str) -> tuple[str, str | None]:
    """``("major:minor", disk)``: the device of the file system under
    ``directory`` and the sysfs directory of its whole disk (a partition's
    parent there), or None for ``disk`` where sysfs has no block device for
    it (tmpfs, network file systems, no sysfs)."""
    st = os.stat(directory)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysdev = os.path.join(_SYS_DEV_BLOCK, dev)
    if not os.path.exists(sysdev):
        return dev, None
    real = os.path.realpath(sysdev)
    return dev, real if os.path.exists(os.path.join(real, "queue")) else os.path.dirname(real)


def device_identity(directory: str) -> dict[str, str]:
    """``{"dev": "major:minor"}`` of the file system under ``directory``,
    with the disk's name, model, vendor, serial and wwid where sysfs says
    (a partition is named by its disk)."""
    dev, disk = block_device(directory)
    ident = {"dev": dev}
    if disk is not None:
        ident["disk"] = os.path.basename(disk)
        for key, rel in _IDENTITY:
            if key not in ident:
                value = read_sysfs(os.path.join(disk, rel))
                if value is not None:
                    ident[key] = value
    return ident


def _key(ident: dict[str, str]) -> str:
    return f"{socket.gethostname()} {ident['dev']}"


def machine() -> dict[str, str]:
    """Host name and CPU model, as a record notes them."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpus": str(os.cpu_count() or 0)}


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn(message: str) -> None:
    """Warn once per process and message."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, TuningWarning, stacklevel=3)


def _load(path: str) -> dict[str, Any] | None:
    """The document at ``path``; None (after one warning) when it does not read."""
    try:
        doc = json.loads(files.read_small_file(path, MAX_RECORD_FILE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _warn(f"fp_dcp: ignoring the tuning record file {path}: it does not read ({e}); "
              f"run `fp-dcp tune DIR` again or delete it")
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), dict):
        _warn(f"fp_dcp: ignoring {path}: not an fp_dcp tuning record file; "
              f"run `fp-dcp tune DIR` again or delete it")
        return None
    if doc.get("version") != VERSION:
        _warn(f"fp_dcp: ignoring {path}: tuning record version {doc.get('version')!r}, this fp_dcp reads "
              f"version {VERSION}; run `fp-dcp tune DIR` again")
        return None
    return doc


def _shape(value: Any, alignment: int) -> Shape:
    """A record's ``{"block_size_bytes", "queue_depth"}``, checked; ValueError otherwise."""
    block, qd = value["block_size_bytes"], value["queue_depth"]
    if type(block) is not int or type(qd) is not int:
        raise ValueError(f"not whole numbers: {value!r}")
    if not (alignment <= block <= MAX_BLOCK_BYTES and 1 <= qd <= MAX_QUEUE_DEPTH
            and block * qd <= MAX_IN_FLIGHT_BYTES):
        raise ValueError(f"out of bounds: {block} bytes x {qd}")
    if block % alignment:
        raise ValueError(f"{block}-byte requests are not a multiple of the directory's alignment ({alignment})")
    return Shape(block, qd)


def lookup(directory: str, alignment: int = 4096) -> Tuned | None:
    """The shapes recorded for the device under ``directory``, or None (no
    record, or one that does not fit: these warn once)."""
    path = record_path()
    if path is None:
        return None
    doc = _load(path)
    if doc is None:
        return None
    try:
        ident = device_identity(directory)
    except OSError:
        return None
    rec = doc["records"].get(_key(ident))
    if rec is None:
        return None
    try:
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        seen = rec.get("device", {})
        changed = sorted(k for k in ident if k != "disk" and k in seen and seen[k] != ident[k])
        if changed:
            raise ValueError(f"recorded for another disk ({', '.join(changed)} differ: "
                             f"{', '.join(f'{seen[k]!r} then, {ident[k]!r} now' for k in changed)})")
        return Tuned(_shape(rec["write"], alignment), _shape(rec["read"], alignment))
    except (KeyError, TypeError, ValueError) as e:
        what = f"{e.args[0]!r} missing" if isinstance(e, KeyError) else str(e)
        _warn(f"fp_dcp: ignoring the tuning record for device {ident['dev']} in {path}: {what}; "
              f"run `fp-dcp tune {directory}` again")
        return None


def store(directory: str, write: Shape, read: Shape, measured: dict[str, Any],
          path: str | None = None) -> str:
    """Record ``write`` / ``read`` (and what was ``measured``) for the device
    under ``directory`` in ``path`` (default :func:`record_path`), keeping the
    other devices' records; an unreadable file is replaced.  Atomic (a new
    file renamed over the old).  Returns the path."""
    path = path or record_path()
    if path is None:
        raise ValueError(f"{ENV}=none turns tuning records off; set it to a file to record one")
    ident = device_identity(directory)
    doc = None
    if os.path.lexists(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TuningWarning)  # replaced below
            doc = _load(path)
    if doc is None:
        doc = {"format": FORMAT, "version": VERSION, "records": {}}
    doc["records"][_key(ident)] = {
        "device": ident,
        "machine": machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "directory": os.path.abspath(directory),
        "write": {"block_size_bytes": write.block_size, "queue_depth": write.queue_depth},
        "read": {"block_size_bytes": read.block_size, "queue_depth": read.queue_depth},
        "measured": measured,
    }
    with files.Root(os.path.dirname(os.path.abspath(path)), create=True) as folder:
        # a temporary created exclusively, synced, renamed over the record
        folder.replace_bytes(os.path.basename(path), (json.dumps(doc, indent=1) + "\n").encode())
    return path
