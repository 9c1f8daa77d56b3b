"""The fault scenarios, each written once: a function that runs one case and
raises ``AssertionError`` when fp_dcp does not survive it.

``tests/test_faults.py`` runs each at a sample of points (and adds what only
a test checks); ``benchmarks/torture.py`` runs the same functions at every
point of its matrix.  State dicts are ``tests/_crash.state_dict(seed)``; a
checkpoint's content is named by its seed (``"seed1"``), or ``"absent"``
when nothing is committed there.

* ``kill_one_rank``: a one-rank save killed at a point of its timeline (see
  ``tests/_crash.py``), over a checkpoint or into a fresh directory;
* ``kill_two_ranks``: one rank of a two-rank save killed at a point;
* ``engine_fault_save`` / ``engine_fault_load``: an injected ENOSPC or EIO
  at an engine completion of a save or a load (``load_requests``: how many
  a load has);
* ``permission_denied``, ``path_is_a_file``; on a size-limited ``tmpfs``
  (root only): ``full_disk``, ``metadata_does_not_fit``,
  ``read_only_file_system``;
* ``two_writers``: two processes saving into one directory at once;
* ``reader_during_saves``: a reader loading while saves replace the
  checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
from typing import Callable, Iterator

from tests import _crash
from tests._sd import failed_save, root_error, save


def load_seed(path) -> str:
    """Which ``state_dict(seed)`` the checkpoint at ``path`` holds, bit for bit
    (``"seedN"``), or ``"absent"`` (see ``_crash.outcome``)."""
    return _crash.outcome(str(path), {f"seed{s}": s for s in range(10)})


def _check(cond: bool, what) -> None:
    if not cond:
        raise AssertionError(what)


def _saves_again(path: str, world: int = 1, options: dict | None = None) -> None:
    """After a crash or a failure: a new save there works, loads back and
    leaves no stray file."""
    if world == 1:
        save(_crash.state_dict(3), path)
    else:
        r = _crash.run_save(path, 3, None, world=world, options=options)
        _check(r["codes"] == [0] * world, f"the save after the crash failed: {r}")
    _check(load_seed(path) == "seed3", "the save after the crash did not load back")
    _check(_crash.leftovers(path) == [], f"stray files: {_crash.leftovers(path)}")


def kill_one_rank(path: str, point: tuple, *, fresh: bool, options: dict | None = None) -> None:
    """Save ``state_dict(2)`` to ``path`` (over ``state_dict(1)``, or into a
    fresh directory), killed at ``point``.  Killed before the commit: the old
    checkpoint, bit for bit (fresh: refused as never committed, saying the
    save was interrupted); after it: the new one.  Saving again works."""
    from fp_dcp.load.reader import read_checkpoint_metadata

    if not fresh:
        save(_crash.state_dict(1), path)
    r = _crash.run_save(path, 2, point, options=options)
    _check(r["killed"] or point[0] == "delay", f"not killed at {point}: {r}")  # a delay may outlast the save
    after = _crash.committed(point) if r["killed"] else True
    before = "absent" if fresh else "seed1"
    ok = (before, "seed2") if after is None else ("seed2",) if after else (before,)
    got = load_seed(path)
    _check(got in ok, f"{point}: found {got}, expected one of {ok}")
    if got == "absent" and os.path.isdir(path) and any(n.endswith(".fpd") for n in os.listdir(path)):
        try:
            read_checkpoint_metadata(path)
            raise AssertionError(f"{point}: an interrupted first save reads as a checkpoint")
        except FileNotFoundError as e:
            _check("interrupted before its commit" in str(e), str(e))
    _saves_again(path)


def kill_two_ranks(path: str, point: tuple, kill_rank: int, options: dict | None = None) -> None:
    """Over the two-rank checkpoint at ``path``, save ``state_dict(2)`` on two
    ranks, ``kill_rank`` killed at ``point``: the checkpoint before (killed
    before the commit) or the new one (after), bit for bit; saving again on
    two ranks works."""
    before = load_seed(path)
    r = _crash.run_save(path, 2, point, world=2, kill_rank=kill_rank, options=options)
    _check(r["killed"] or point[0] == "delay", f"not killed at {point}: {r}")
    after = _crash.committed(point) if r["killed"] else True
    ok = (before, "seed2") if after is None else ("seed2",) if after else (before,)
    got = load_seed(path)
    _check(got in ok, f"rank {kill_rank} {point}: found {got}, expected one of {ok}")
    _saves_again(path, world=2, options=options)


def engine_fault_save(path: str, err: int, after: int, options: dict | None = None) -> None:
    """Over ``state_dict(1)`` at ``path``, a save failing with ``err`` at its
    engine's completion ``after``: an OSError naming the data file and the
    cause; the previous checkpoint loads bit for bit; the failed save
    removed its own files."""
    from fp_dcp import _native

    _native.testing().set_fault("io", err, after=after)
    try:
        e = failed_save(_crash.state_dict(2), path, **(options or {}))
    finally:
        _native.testing().set_fault("")
    _check(isinstance(e, OSError) and e.errno == err, f"got {e!r}")
    _check(bool(e.filename) and e.filename.startswith(str(path)) and e.filename.endswith(".fpd"),
           f"the error does not name the data file: {e!r}")
    _check(os.strerror(err) in str(e), f"the error does not say {os.strerror(err)!r}: {e}")
    _check(load_seed(path) == "seed1", "the previous checkpoint does not load")
    _check(_crash.leftovers(str(path)) == [], f"stray files: {_crash.leftovers(str(path))}")


def load_requests(path: str) -> int:
    """The engine requests (so completions) of a load of ``state_dict`` at
    ``path``: the points ``engine_fault_load`` can fail at."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    r = FastPersistReader(path)
    try:
        dcp.load(_crash.zeros_like(_crash.state_dict(0)), storage_reader=r)
        return r.last_stats["requests"]
    finally:
        r.close()


def engine_fault_load(path: str, after: int) -> None:
    """A load of ``state_dict(1)`` at ``path`` failing with EIO at its
    engine's completion ``after``: an OSError naming the data file; the
    checkpoint still loads."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, _native

    r = FastPersistReader(path)
    _native.testing().set_fault("io", errno.EIO, after=after)
    try:
        try:
            dcp.load(_crash.zeros_like(_crash.state_dict(0)), storage_reader=r)
            raise AssertionError(f"the load with EIO at completion {after} succeeded")
        except AssertionError:
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP wraps the rank's error
            e = root_error(exc)
    finally:
        _native.testing().set_fault("")
        r.close()
    _check(isinstance(e, OSError) and e.errno == errno.EIO and str(path) in str(e.filename), repr(e))
    _check(load_seed(path) == "seed1", "the checkpoint no longer loads")


def permission_denied(path: str) -> None:
    """Over ``state_dict(1)`` at ``path``, a save refused EACCES: a
    PermissionError naming the file; the checkpoint loads; saving again
    works.  Root ignores file modes: EACCES is injected at the O_DIRECT open
    (as the probe and the engine see it); without root, a read-only
    directory."""
    from fp_dcp import _native

    save(_crash.state_dict(1), path)
    if os.geteuid() == 0:
        _native.testing().set_fault("open_direct", errno.EACCES)
    else:
        os.chmod(path, 0o500)
    try:
        e = failed_save(_crash.state_dict(2), path)
    finally:
        _native.testing().set_fault("")
        os.chmod(path, 0o755)
    _check(isinstance(e, PermissionError), repr(e))
    _check(str(path) in str(e.filename) and "Permission denied" in str(e), str(e))
    _check(load_seed(path) == "seed1", "the previous checkpoint does not load")
    _saves_again(path)


def path_is_a_file(f: str) -> None:
    """A save to ``f``, a regular file, and to ``f/sub`` is refused naming it,
    and the file is left as it was; a load from it is refused naming it."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    with open(f, "wb") as fh:
        fh.write(b"precious")
    e = failed_save(_crash.state_dict(1), f)
    _check(isinstance(e, (NotADirectoryError, FileExistsError)) and e.filename == str(f), repr(e))
    _check("not a directory" in str(e) or "cannot create the checkpoint directory: File exists" in str(e), str(e))
    e = failed_save(_crash.state_dict(1), os.path.join(f, "sub"))
    _check(isinstance(e, OSError) and e.errno == errno.ENOTDIR and str(f) in e.filename, repr(e))
    _check("cannot create the checkpoint directory" in str(e), str(e))
    with open(f, "rb") as fh:
        _check(fh.read() == b"precious", "the file was touched")
    try:
        dcp.load(_crash.zeros_like(_crash.state_dict(0)), storage_reader=FastPersistReader(f))
        raise AssertionError("loaded a checkpoint from a regular file")
    except AssertionError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP wraps the rank's error
        _check(str(f) in str(e), str(e))


@contextlib.contextmanager
def tmpfs(path: str, size: str, skip: Callable[[str], None]) -> Iterator[str]:
    """A tmpfs of ``size`` (``"6m"``) mounted at ``path`` for the block, then
    unmounted; where it cannot be mounted (not root) ``skip(why)``, which
    raises."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(mnt: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", mnt], check=True, capture_output=True)


def full_disk(mnt: str, mib: int) -> None:
    """On ``mnt``, a 6 MiB tmpfs: a 1 MiB checkpoint fits, a ``mib`` MiB one
    does not.  The error is ENOSPC naming the file, the small one still
    loads, the failed save gave its space back, and saving a small one again
    works."""
    import torch

    path = os.path.join(mnt, "c")
    small = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    save(small, path)
    e = failed_save({"w": torch.arange(mib << 18, dtype=torch.float32)}, path)
    _check(isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e))
    _check(bool(e.filename) and e.filename.startswith(path) and "No space left on device" in str(e), str(e))
    _check(_crash.leftovers(path) == [], f"stray files: {_crash.leftovers(path)}")
    _check(shutil.disk_usage(mnt).used < 3 << 20, "the failed save kept its space")  # the partial data files are gone
    target = {"w": torch.zeros(1 << 18)}
    _load(target, path)
    _check(torch.equal(target["w"], small["w"]), "the small checkpoint no longer loads")
    small2 = {"w": -small["w"]}
    save(small2, path)
    _load(target, path)
    _check(torch.equal(target["w"], small2["w"]), "the save after the failure did not load back")


def _load(target: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    dcp.load(target, storage_reader=FastPersistReader(path))


def metadata_does_not_fit(mnt: str) -> None:
    """On ``mnt``, a 1 MiB tmpfs, the data fits but the metadata write hits
    ENOSPC: nothing is committed and the new save's files are removed."""
    import torch

    path = os.path.join(mnt, "c")
    sd = {f"t{i}": torch.zeros(1) for i in range(6000)}  # 384 KiB of data, 1 MiB of metadata
    e = failed_save(sd, path)
    _check(isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e))
    _check(".fp_dcp.meta" in e.filename and "cannot write the checkpoint metadata" in str(e), str(e))
    _check([x for x in os.listdir(path) if x != ".fp_dcp.lock"] == [], f"stray files: {os.listdir(path)}")


def read_only_file_system(mnt: str) -> None:
    """On ``mnt``, a tmpfs remounted read-only after a save: a save is refused
    EROFS naming the file, the checkpoint loads from the read-only mount;
    back read-write, saving again works."""
    path = os.path.join(mnt, "c")
    save(_crash.state_dict(1), path)
    _remount(mnt, "ro")
    try:
        e = failed_save(_crash.state_dict(2), path)
        _check(isinstance(e, OSError) and e.errno == errno.EROFS and e.filename.startswith(path), repr(e))
        _check(load_seed(path) == "seed1", "the checkpoint does not load from the read-only mount")
    finally:
        _remount(mnt, "rw")
    save(_crash.state_dict(3), path)
    _check(load_seed(path) == "seed3", "the save after the remount did not load back")


def two_writers(path: str, pauses: tuple[float, float]) -> None:
    """Over ``state_dict(1)``, two processes save ``state_dict(2)`` and
    ``state_dict(3)`` into ``path`` at once, each pausing ``pauses[i]``
    seconds with the directory locked before its commit: one wins, the other
    is refused with a clear error (or both win, one after the other); the
    result is one of the two, bit for bit, never a mixture."""
    save(_crash.state_dict(1), path)
    results: list = [None, None]

    def go(i: int) -> None:
        results[i] = _crash.run_save(path, 2 + i, ("pause", "write", 0, pauses[i]))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = []
    for i, r in enumerate(results):
        v = r["results"].get(0)
        _check(r["codes"] == [0] and v is not None, f"no result: {r}")
        if isinstance(v, dict):
            won.append(f"seed{2 + i}")
        else:
            _check("another fp_dcp save into this checkpoint directory is in progress" in v[1], v)
    got = load_seed(path)
    _check(bool(won) and got in won, f"won {won}, found {got}")
    _check(_crash.leftovers(path) == [], f"stray files: {_crash.leftovers(path)}")


def reader_during_saves(path: str) -> None:
    """Over ``state_dict(1)``, saves of seeds 2, 3, 4 in another process while
    this one loads again and again: every load is one of them, bit for bit,
    or a clear error (the files it started to read were replaced by a
    commit); the last save loads after."""
    save(_crash.state_dict(1), path)
    seen: list[str] = []
    codes: list = []
    stop = threading.Event()

    def saves() -> None:
        try:
            for seed in (2, 3, 4):
                codes.append(_crash.run_save(path, seed, None, options={"block_size_bytes": 128 << 10})["codes"])
        finally:
            stop.set()

    t = threading.Thread(target=saves)
    t.start()
    try:
        while not stop.is_set():
            try:
                seen.append(load_seed(path))
            except AssertionError as e:
                msg = str(e)
                _check("data file of the checkpoint is missing" in msg or "No such file" in msg, msg)
                seen.append("error")
    finally:
        t.join()
    _check(codes == [[0]] * 3, f"a save failed: {codes}")
    _check(set(seen) <= {"seed1", "seed2", "seed3", "seed4", "error"}, f"saw {set(seen)}")
    _check(load_seed(path) == "seed4", "the last save did not load")
