"""The fault matrix of fp_dcp, run in full, and the cost of checksums.

    python benchmarks/torture.py [--quick] [--dir D] [--json OUT]
    flock /tmp/fp_dcp_bench.lock python benchmarks/torture.py --bench-checksums [--size 2GiB] [--rounds 5]

The first form runs every case below and prints how many were tried and how
many survived with nothing lost; exit status 1 if any did not.

The kills, the engine and file-system faults and the concurrency cases run
the scenarios of ``tests/_scenarios.py``: the same functions
``tests/test_faults.py`` runs at a sample of points, here at every point.
Short transfers, the corruptions, rotation and the attacks (the tests of
``tests/test_security.py``) are this matrix's own.

* kill-1-rank / kill-2-ranks: a saving process (or one rank of two) is
  SIGKILLed at every I/O completion of its engine, before every call of the
  commit protocol (lock, temporary metadata open/write/fsync, the rename,
  the directory fsync, each removal of a superseded file), right after the
  save, and at random moments; over an existing checkpoint and into a fresh
  directory.  Survived: the directory loads as the old checkpoint (killed
  before the rename) or the new one (after), bit for bit, or, fresh, is
  refused as never committed; the next save there works and leaves no stray
  file.
* engine-fault-save / engine-fault-load / short-transfers: ENOSPC and EIO
  injected at every completion of a save, EIO along a load, short transfers:
  the error is an OSError naming the data file and the cause, the previous
  checkpoint loads bit for bit, the failed save left no file, and nothing
  leaked (descriptors, threads, AIO rings, buffers, locked memory, requests).
* file-system: a full tmpfs (data and metadata), a read-only mount, EACCES,
  a path that is a file, a parent that is a file (tmpfs cases need root).
* corrupt-data / corrupt-metadata: random byte flips in data files (caught
  by the checksums on load and by ``fp-dcp verify``, or harmless in
  padding), truncated and deleted data files, flipped and truncated metadata.
* concurrency: two writers into one directory; a reader during saves.
* rotation: 200 saves with ``keep_last(3)``, no leak.
* kill-drain: a ``TierManager`` job killed during its drain to the
  persistent tier, at every point of the drain protocol and at random
  moments (``tests/_tiers_child.py``).  Survived: the persistent tier's
  newest committed step is the previous drained step or the new one, whole
  (every checksum verified, loads bit for bit), never a mix; a rerun of the
  job drains again and leaves nothing uncommitted behind.
* attacks: every attack of ``tests/test_security.py`` (pickled payloads,
  metadata naming files outside the checkpoint, planted symbolic links,
  native-layer overflows, the metadata fuzzer) and of the tiers
  (``tests/test_tiers_attacks.py``, ``tests/test_tiers_wire.py``: foreign
  checkpoints and folders in the tiers' roots, step folders planted as
  links, second spellings of a step, FIFOs, lying peers): no code runs,
  nothing outside the checkpoint or not the tiers' is read, written or
  deleted, and no rank waits on a FIFO or a peer.

``--bench-checksums`` measures save and load throughput with checksums on and
off in the same run (alternating, cold cache for loads), through DCP, and
the engine alone.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# the fault scenarios drive fp_dcp's test hooks (fp_dcp._native.testing()); read when fp_dcp is imported
os.environ.setdefault("FP_DCP_TEST_HOOKS", "1")

OPTS = {"block_size_bytes": 256 << 10}  # small requests: many kill points


class Matrix:
    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.failures: list[str] = []

    @contextlib.contextmanager
    def case(self, category: str, name: str):
        row = self.rows.setdefault(category, [0, 0])
        row[0] += 1
        try:
            yield
        except unittest_skip:
            row[0] -= 1  # not tried here (needs root)
            raise
        except BaseException as e:  # noqa: BLE001 - a case that did not survive
            if isinstance(e, KeyboardInterrupt):
                raise
            self.failures.append(f"{category} {name}: {type(e).__name__}: {str(e)[-1500:]}")
            print(f"  FAILED {category} {name}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
        else:
            row[1] += 1


# The test suite's helpers and scenarios (tests/_sd.py, tests/_scenarios.py),
# imported when used, as this script imports torch (which they need) only
# where it is used.
def _root_error(exc: BaseException) -> BaseException:
    from tests._sd import root_error

    return root_error(exc)


def _save(sd, path, **kw):
    from tests._sd import save

    save(sd, path, **kw)


def _seed(path) -> str:
    from tests._scenarios import load_seed

    return load_seed(path)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# ------------------------------------------------------------------ kills


def kills_one_rank(m: Matrix, base: str, quick: bool) -> None:
    from tests import _crash, _scenarios

    counts = _crash.count_points(os.path.join(base, "count1"), 1, options=OPTS)
    pts = _crash.points(counts, engine_points=6 if quick else None)
    delays = random.Random(127)
    pts += [("delay", delays.uniform(0.02, 0.8)) for _ in range(3 if quick else 12)]
    print(f"kill-1-rank: {len(pts)} points, over a checkpoint and into a fresh directory "
          f"({counts['requests'][0]} engine requests, calls {counts['calls']})", flush=True)
    for i, point in enumerate(pts):
        for scenario in ("overwrite", "fresh"):
            if scenario == "fresh" and point[:2] == ("call", "unlink"):
                continue  # a first save supersedes nothing
            with m.case("kill-1-rank", f"{scenario} {point}"):
                path = os.path.join(base, f"k1-{i}-{scenario}")
                _scenarios.kill_one_rank(path, point, fresh=scenario == "fresh", options=OPTS)
                shutil.rmtree(path)


def kills_two_ranks(m: Matrix, base: str, quick: bool) -> None:
    from tests import _crash, _scenarios

    counts = _crash.count_points(os.path.join(base, "count2"), 1, world=2, options=OPTS)
    cases = [(p, 0) for p in _crash.points(counts, kill_rank=0, engine_points=3 if quick else None)]
    cases += [(p, 1) for p in _crash.points(counts, kill_rank=1, engine_points=3 if quick else None)]
    delays = random.Random(161)
    cases += [(("delay", delays.uniform(0.2, 2.0)), 0) for _ in range(2 if quick else 6)]
    print(f"kill-2-ranks: {len(cases)} points (requests per rank {counts['requests']})", flush=True)
    path = os.path.join(base, "k2")
    r = _crash.run_save(path, 1, None, world=2, options=OPTS)
    _expect(r["codes"] == [0, 0], f"first save failed: {r}")
    for point, rank in cases:
        with m.case("kill-2-ranks", f"rank {rank} {point}"):
            _scenarios.kill_two_ranks(path, point, rank, OPTS)


# ------------------------------------------------------------------ injected and real faults


def _no_leak(before: dict) -> None:
    from tests._crash import settle

    leaked = settle(before)
    _expect(not leaked, f"leaked (before, after): {leaked}")


def engine_faults(m: Matrix, base: str, quick: bool) -> None:
    from fp_dcp import _native
    from tests import _crash, _scenarios

    hooks = _native.testing()

    path = os.path.join(base, "ef")
    n = _crash.count_points(os.path.join(base, "count-ef"), 1, options=OPTS)["requests"][0]
    _save(_crash.state_dict(1), path, **OPTS)
    _seed(path)  # warm-up: torch's thread pools exist before the first snapshot
    before = _crash.resources()
    ks = range(0, n, 4 if quick else 1)
    for err in (errno.ENOSPC, errno.EIO):
        for k in ks:
            with m.case("engine-fault-save", f"{errno.errorcode[err]} at completion {k}"):
                _scenarios.engine_fault_save(path, err, k, OPTS)
                _no_leak(before)
    # every completion of the load (it has few: drawing beyond them tried loads that cannot fail)
    for k in range(_scenarios.load_requests(path)):
        with m.case("engine-fault-load", f"EIO at completion {k}"):
            _scenarios.engine_fault_load(path, k)
            _no_leak(before)
    for n_short in (1, 3, 7, 20):
        with m.case("short-transfers", f"{n_short} short completions, save and load"):
            p2 = os.path.join(base, f"short{n_short}")
            hooks.set_fault("short", after=n_short)
            try:
                _save(_crash.state_dict(4), p2, **OPTS)
            finally:
                hooks.set_fault("")
            hooks.set_fault("short", after=n_short)
            try:
                got = _seed(p2)
            finally:
                hooks.set_fault("")
            _expect(got == "seed4", f"loaded {got}")
            shutil.rmtree(p2)
            _no_leak(before)


class unittest_skip(Exception):
    pass


def _skip(why: str) -> None:
    raise unittest_skip(why)


def file_system_faults(m: Matrix, base: str, quick: bool) -> None:
    from tests import _scenarios

    sizes = [8, 12, 20] if quick else [7, 8, 9, 10, 12, 16, 20, 24, 32]
    for mib in sizes:
        try:
            with m.case("file-system", f"full disk: {mib} MiB into 6 MiB"), \
                    _scenarios.tmpfs(os.path.join(base, f"m{mib}"), "6m", _skip) as mnt:
                _scenarios.full_disk(mnt, mib)
        except unittest_skip as s:
            print(f"  skipped: {s}")
            break

    def on_tmpfs(name: str, size: str, scenario):
        def case():
            with _scenarios.tmpfs(os.path.join(base, name), size, _skip) as mnt:
                scenario(mnt)
        return case

    cases = [("metadata does not fit", on_tmpfs("mm", "1m", _scenarios.metadata_does_not_fit)),
             ("read-only file system", on_tmpfs("ro", "16m", _scenarios.read_only_file_system)),
             ("permission denied (injected EACCES)", lambda: _scenarios.permission_denied(os.path.join(base, "acc"))),
             ("path is a file / parent is a file", lambda: _scenarios.path_is_a_file(os.path.join(base, "afile")))]
    for name, fn in cases:
        try:
            with m.case("file-system", name):
                fn()
        except unittest_skip as s:
            print(f"  skipped {name}: {s}")


# ------------------------------------------------------------------ bad input


def corrupt_data(m: Matrix, base: str, quick: bool) -> None:
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader
    from fp_dcp.tools import verify as verify_mod
    from fp_dcp.load.reader import read_checkpoint_metadata
    from tests import _crash

    path = os.path.join(base, "cd")
    _save(_crash.state_dict(5), path)
    _, layout, _ = read_checkpoint_metadata(path)
    files = [os.path.join(path, n) for n, _ in layout.files]
    spans = [(e.file, e.file_offset, e.file_offset + e.length) for es in layout.extents.values() for e in es]
    rng = random.Random(7)
    for i in range(30 if quick else 200):
        fid = rng.randrange(len(files))
        size = os.path.getsize(files[fid])
        at = rng.randrange(size)
        inside = any(f == fid and a <= at < b for f, a, b in spans)
        with m.case("corrupt-data", f"flip byte {at} of file {fid} ({'extent' if inside else 'padding'})"):
            with open(files[fid], "r+b") as fh:
                fh.seek(at)
                old = fh.read(1)
                fh.seek(at)
                fh.write(bytes([old[0] ^ (1 << rng.randrange(8))]))
            try:
                try:
                    got = _seed(path)
                except AssertionError as e:
                    got = str(e)
                if inside:
                    _expect("checksum mismatch" in got and os.path.basename(files[fid]) in got, got[-500:])
                else:
                    _expect(got == "seed5", got[-500:])
                report = verify_mod.verify_checkpoint(path)
                _expect(report.ok != inside, f"verify ok={report.ok} for a flip {'in' if inside else 'outside'} an extent")
                if inside:
                    _expect(len(report.bad) == 1 and report.bad[0].path == files[fid], "verify named the wrong place")
            finally:
                with open(files[fid], "r+b") as fh:
                    fh.seek(at)
                    fh.write(old)
    for i in range(5 if quick else 20):
        fid = rng.randrange(len(files))
        size = os.path.getsize(files[fid])
        cut = rng.randrange(size)
        with m.case("corrupt-data", f"truncate file {fid} to {cut}"):
            keep = open(files[fid], "rb").read()
            os.truncate(files[fid], cut)
            try:
                try:
                    dcp.load(_crash.zeros_like(_crash.state_dict(0)), storage_reader=FastPersistReader(path))
                    raise AssertionError("loaded a truncated checkpoint")
                except BaseException as exc:  # noqa: BLE001
                    e = _root_error(exc)
                    _expect("truncated" in str(e) and files[fid] in str(e), repr(e))
                _expect(not verify_mod.verify_checkpoint(path).ok, "verify passed a truncated file")
            finally:
                with open(files[fid], "wb") as fh:
                    fh.write(keep)
    with m.case("corrupt-data", "deleted data file"):
        keep = open(files[0], "rb").read()
        os.unlink(files[0])
        try:
            try:
                _seed(path)
                raise RuntimeError("loaded without a data file")
            except AssertionError as e:
                _expect("data file of the checkpoint is missing" in str(e), str(e))
            _expect(not verify_mod.verify_checkpoint(path).ok, "verify passed a missing file")
        finally:
            with open(files[0], "wb") as fh:
                fh.write(keep)
    _expect(_seed(path) == "seed5", "the checkpoint was not restored")


def corrupt_metadata(m: Matrix, base: str, quick: bool) -> None:
    from fp_dcp import format as fmt
    from fp_dcp.load.reader import read_checkpoint_metadata
    from tests import _crash

    path = os.path.join(base, "cm")
    _save(_crash.state_dict(6), path)
    meta = os.path.join(path, fmt.METADATA_NAME)
    raw = open(meta, "rb").read()
    rng = random.Random(8)
    n = 30 if quick else 300
    for i in range(n):
        kind = "flip" if i % 3 else "truncate"
        with m.case("corrupt-metadata", f"{kind} #{i}"):
            if kind == "flip":
                at = rng.randrange(len(raw))
                bad = raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:]
            else:
                bad = raw[: rng.randrange(len(raw))]
            with open(meta, "wb") as f:
                f.write(bad)
            try:
                read_checkpoint_metadata(path)
                raise AssertionError("damaged metadata was accepted")
            except fmt.CheckpointFormatError as e:
                _expect(meta in str(e), str(e))
    with open(meta, "wb") as f:
        f.write(raw)
    _expect(_seed(path) == "seed6", "the checkpoint was not restored")


# ------------------------------------------------------------------ attacks


def attacks(m: Matrix, base: str, quick: bool) -> None:
    """Every attack of tests/test_security.py (crafted objects, metadata naming
    files outside, planted links, native overflows, and the metadata fuzzer),
    run from there, each a case of the matrix."""
    import inspect

    from tests import test_security as ts

    cases = [(name, fn, {}) for name, fn in vars(ts).items()
             if name.startswith("test_") and list(inspect.signature(fn).parameters) == ["tmp_path"]]
    cases += [(f"test_symbolic_links_planted_in_a_checkpoint_are_not_followed[{p}]",
               ts.test_symbolic_links_planted_in_a_checkpoint_are_not_followed, {"planted": p})
              for p in ("data", "metadata", "subdir")]
    cases += [(f"test_native_layer_rejects_offsets_that_would_overflow[{o}]",
               ts.test_native_layer_rejects_offsets_that_would_overflow, {"offset": o}) for o in (1 << 62, (1 << 63) - 4096)]
    cases += _tier_attacks()
    print(f"attacks: {len(cases) + 1} cases", flush=True)
    for name, fn, kw in cases:
        with m.case("attacks", name):
            if "tmp_path" in inspect.signature(fn).parameters:
                kw = {"tmp_path": Path(tempfile.mkdtemp(dir=base)), **kw}
            fn(**kw)
    with m.case("attacks", "metadata fuzzer (load, inspect, verify, rotation)"):
        ts.test_fuzzed_metadata_never_escapes_the_checkpoint(pristine=ts.make_pristine(Path(tempfile.mkdtemp(dir=base))))


def _tier_attacks() -> list:
    """Every test of tests/test_tiers_attacks.py and tests/test_tiers_wire.py
    (foreign folders and checkpoints in the tiers' roots, planted links,
    second spellings of a step, FIFOs, lying peers), each parameter a case."""
    import inspect

    from tests import test_tiers_attacks, test_tiers_wire

    cases = []
    for module in (test_tiers_attacks, test_tiers_wire):
        for name, fn in vars(module).items():
            if not name.startswith("test_") or set(inspect.signature(fn).parameters) - {"tmp_path", *_params(fn)}:
                continue
            grid = [{}]
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize":
                    grid = [{**g, mark.args[0]: v} for g in grid for v in mark.args[1]]
            cases += [(f"{name}[{'-'.join(map(str, g.values()))}]" if g else name, fn, g) for g in grid]
    return cases


def _params(fn) -> list[str]:
    return [m.args[0] for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]


# ------------------------------------------------------------------ concurrency and rotation


def concurrency(m: Matrix, base: str, quick: bool) -> None:
    from tests import _scenarios

    for i in range(3 if quick else 10):
        with m.case("concurrency", f"two writers #{i}"):
            _scenarios.two_writers(os.path.join(base, f"tw{i}"),
                                   tuple(random.Random(490 + j).uniform(0, 0.4) for j in range(2)))
    for i in range(2 if quick else 5):
        with m.case("concurrency", f"reader during saves #{i}"):
            _scenarios.reader_during_saves(os.path.join(base, f"rd{i}"))


def rotation(m: Matrix, base: str, quick: bool) -> None:
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter
    from fp_dcp.tools.rotation import keep_last
    from tests import _crash

    with m.case("rotation", "200 saves, keep_last(3)"):
        root = os.path.join(base, "rot")
        os.makedirs(root)
        sd = {"w": torch.from_numpy(np.random.default_rng(0).standard_normal(70000, dtype=np.float32)), "step": 0}
        w = FastPersistWriter()
        dcp.save(sd, storage_writer=w, checkpoint_id=os.path.join(root, "warm"))
        w.close()
        shutil.rmtree(os.path.join(root, "warm"))
        before = _crash.resources()
        w = FastPersistWriter()
        try:
            for step in range(200):
                sd["step"] = step
                dcp.save(sd, storage_writer=w, checkpoint_id=os.path.join(root, f"s{step:04d}"))
                keep_last(root, 3)
        finally:
            w.close()
        _expect(sorted(os.listdir(root)) == ["s0197", "s0198", "s0199"], f"{sorted(os.listdir(root))}")
        leaked = _crash.settle(before)
        _expect(not leaked, f"leaked (before, after): {leaked}")


# ------------------------------------------------------------------ checksum cost


def kills_during_drain(m: Matrix, base: str, quick: bool) -> None:
    """Multi-tier checkpointing: a job killed while it drains step 4 to the
    persistent tier (the points of ``fp_dcp.tiers.drain``, then random
    moments)."""
    from fp_dcp.tiers import store
    from fp_dcp.tools.rotation import committed_checkpoints
    from fp_dcp.tools.verify import verify_checkpoint
    from tests._tiers_child import check_loads

    rng = random.Random(17)
    points = ["start", "copied", "before-commit", "committed"]
    points += [f"delay:{rng.uniform(0.0, 0.05):.4f}" for _ in range(2 if quick else 8)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def job(root: str, point: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests._tiers_child", root, point], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=300)

    print(f"kill-drain: {len(points)} points", flush=True)
    for i, point in enumerate(points):
        with m.case("kill-drain", point):
            root = os.path.join(base, f"drain-{i}")
            os.makedirs(root)
            r = job(root, point)
            _expect(r.returncode in (0, 9), f"exit {r.returncode}: {r.stderr[-800:]}")
            persist = os.path.join(root, "persist")
            committed = committed_checkpoints(persist)
            newest = max(s for s, p in store.steps(persist) if p in committed)
            _expect(newest in (2, 4), f"newest committed step {newest}")
            _expect(newest == 4 or r.returncode == 9, "not killed, yet step 4 was not committed")
            path = store.step_dir(persist, newest)
            _expect(verify_checkpoint(path).ok, f"{path} does not verify")
            check_loads(path, newest)
            r = job(root, "never")  # the job again: it drains, and tidies what the kill left
            _expect(r.returncode == 0, f"the rerun failed: {r.stderr[-800:]}")
            for s, p in store.steps(persist):
                _expect(p in committed_checkpoints(persist), f"uncommitted {p} left behind")
                _expect(verify_checkpoint(p).ok, f"{p} does not verify")
                check_loads(p, s)
            shutil.rmtree(root)


def bench_checksums(args) -> int:
    # run under `flock /tmp/fp_dcp_bench.lock` (see the docstring): taking the lock here too, on a
    # second open of the file, waited forever for the flock that started this process
    import torch
    import torch.distributed.checkpoint as dcp

    import _common as C
    from fp_dcp import FastPersistReader, FastPersistWriter
    from fp_dcp.options import parse_size

    torch.set_num_threads(1)
    size = parse_size(args.size)
    base = Path(args.dir or tempfile.mkdtemp(prefix="fp_dcp_crc_", dir=str(ROOT.parent / "bench_tmp")
                                             if (ROOT.parent / "bench_tmp").is_dir() else None))
    base.mkdir(parents=True, exist_ok=True)
    C.check_free_space(base, 3 * size)
    hw = C.hardware_info(base)
    print("\n".join(C.hardware_lines(hw)))
    results: dict = {"hardware": hw, "size_bytes": size, "rounds": args.rounds, "dcp": {}, "engine": {}}
    try:
        for mix in ("large", "small"):
            spec = C.make_spec(mix, size if mix == "large" else size // 4, seed=3)
            fac = C.StateDictFactory(spec)
            sd = fac.build()
            target = fac.build(zero=True)
            nbytes = spec.payload_bytes
            times: dict[str, list[float]] = {"save off": [], "save on": [], "load off": [], "load on": []}
            for rnd in range(args.rounds):
                order = (False, True) if rnd % 2 == 0 else (True, False)
                for on in order:
                    path = base / f"{mix}-{'on' if on else 'off'}"
                    w = FastPersistWriter(path, write_checksums=on)
                    C.drop_caches()
                    t = time.perf_counter()
                    dcp.save(sd, storage_writer=w)
                    times[f"save {'on' if on else 'off'}"].append(nbytes / (time.perf_counter() - t) / 1e9)
                    w.close()
                for on in order:
                    C.drop_caches()
                    r = FastPersistReader(base / f"{mix}-on", verify_checksums=on)
                    t = time.perf_counter()
                    dcp.load(target, storage_reader=r)
                    times[f"load {'on' if on else 'off'}"].append(nbytes / (time.perf_counter() - t) / 1e9)
                    if on:
                        verified = r.last_stats.get("checksum_verified_bytes", 0)
                    r.close()
            errors = fac.verify(target)
            if errors:
                raise SystemExit(f"{mix}: loaded state dict differs: {errors}")
            results["dcp"][mix] = {"payload_bytes": nbytes, "gbps": times, "verified_bytes": verified}
        for op in ("write", "read"):
            for mode in ("zc", "copy"):
                results["engine"][f"{op} {mode}"] = _engine_bench(base, op, mode, min(size, 1 << 30), args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []

    def row(name: str, off: list[float], on: list[float]) -> list[str]:
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        paired = med([b / a for a, b in zip(off, on)])  # rounds alternate the order: drift cancels
        return [name, f"{med(off):.2f}", f"{med(on):.2f}", f"{100 * (1 - paired):.1f}",
                f"{max(off):.2f}", f"{max(on):.2f}", f"{100 * (1 - max(on) / max(off)):.1f}"]

    for mix, r in results["dcp"].items():
        for op in ("save", "load"):
            rows.append(row(f"dcp {op}, {mix} ({C.fmt_size(r['payload_bytes'])})",
                            r["gbps"][f"{op} off"], r["gbps"][f"{op} on"]))
    for name, r in results["engine"].items():
        rows.append(row(f"engine {name} (1 GiB)", r["off"], r["on"]))
    print()
    print(C.format_table(["GB/s, same run", "median off", "median on", "cost % (paired median)",
                          "best off", "best on", "cost % (best)"], rows))
    if args.json:
        C.write_json(args.json, results)
    return 0


def _engine_bench(base: Path, op: str, mode: str, n: int, rounds: int) -> dict:
    import numpy as np

    import _common as C
    from fp_dcp import _native

    path = str(base / "engine.bin")
    buf = _native.AlignedBuffer(n + 4096, 4096)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, n + 4096, dtype=np.uint8)
    view = memoryview(buf)[0:n] if mode == "zc" else memoryview(buf)[1:n + 1]
    out: dict[str, list[float]] = {"off": [], "on": []}
    try:
        with _native.Engine("auto") as eng:
            if op == "read":
                fd = eng.open(path, "w")
                eng.write([fd], [path], [0], [0], [view])
                os.close(fd)
            for rnd in range(rounds):
                for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                    fd = eng.open(path, op[0])
                    try:
                        C.drop_caches()
                        t = time.perf_counter()
                        if op == "write":
                            eng.write([fd], [path], [0], [0], [view], checksums=(1 << 20) if on else False)
                        else:
                            eng.read([fd], [path], [0], [0], [view], checksums=(1 << 20) if on else False)
                        out["on" if on else "off"].append(n / (time.perf_counter() - t) / 1e9)
                    finally:
                        os.close(fd)
    finally:
        view.release()
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    return out


# ------------------------------------------------------------------ main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a sample of every category (about a minute)")
    p.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--only", default=None, help="comma-separated categories")
    p.add_argument("--bench-checksums", action="store_true", help="measure the cost of checksums instead")
    p.add_argument("--size", default="2GiB", help="--bench-checksums: state dict size")
    p.add_argument("--rounds", type=int, default=5, help="--bench-checksums: rounds (alternating order)")
    args = p.parse_args()
    if args.bench_checksums:
        return bench_checksums(args)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # DCP warns on every single-process save; children inherit this
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning"
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # DCP logs a traceback for every refused load (the cases expect them)
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    base = args.dir or tempfile.mkdtemp(prefix="fp_dcp_torture_")
    os.makedirs(base, exist_ok=True)
    steps = [
        ("kill-1-rank", kills_one_rank),
        ("kill-2-ranks", kills_two_ranks),
        ("engine-fault", engine_faults),
        ("file-system", file_system_faults),
        ("corrupt-data", corrupt_data),
        ("corrupt-metadata", corrupt_metadata),
        ("concurrency", concurrency),
        ("rotation", rotation),
        ("attacks", attacks),
        ("kill-drain", kills_during_drain),
    ]
    only = set(args.only.split(",")) if args.only else None
    m = Matrix()
    t0 = time.perf_counter()
    try:
        for name, fn in steps:
            if only and name not in only:
                continue
            t = time.perf_counter()
            try:
                fn(m, base, args.quick)
            except Exception:  # noqa: BLE001 - the setup of a category failed
                m.failures.append(f"{name}: setup failed:\n{traceback.format_exc()}")
                m.rows.setdefault(name, [0, 0])[0] += 1
                print(f"  {name}: setup failed\n{traceback.format_exc()}", flush=True)
            print(f"{name}: done in {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    tried = sum(r[0] for r in m.rows.values())
    survived = sum(r[1] for r in m.rows.values())
    print()
    width = max(len(k) for k in m.rows) if m.rows else 10
    print(f"{'category'.ljust(width)}  tried  survived")
    for k, (a, b) in m.rows.items():
        print(f"{k.ljust(width)}  {a:5d}  {b:8d}")
    print(f"{'total'.ljust(width)}  {tried:5d}  {survived:8d}")
    print(f"\n{survived} of {tried} fault cases survived with nothing lost "
          f"({time.perf_counter() - t0:.0f} s{', --quick' if args.quick else ''})")
    for f in m.failures:
        print("FAILED", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": m.rows, "tried": tried, "survived": survived, "failures": m.failures,
                       "quick": args.quick}, f, indent=1)
    return 0 if survived == tried and not m.failures else 1


if __name__ == "__main__":
    sys.exit(main())
