#!/usr/bin/env python
"""Request size x queue depth of fp_dcp's read engine in both device profiles.

    flock /tmp/fp_dcp_bench.lock python benchmarks/sweep_requests.py --size 1GiB --json bench_out/sweep.json

For each device profile (``bare``; ``throttled``: the same disk limited to
``--throttle-iops`` operations per second by a cgroup v1 blkio group, as in
bench_save_load.py) and each (read block size, queue depth): a cold O_DIRECT
read of one ``--size`` file through fp_dcp._aio into memory laid out the way
DCP hands it to the reader (``torch``: 64 bytes past a page, as torch's
allocator places large tensors, so every byte goes through the bounce
buffers, with checksums on as a verified load does; ``zc``: page-aligned,
straight into the destination) and a ``scatter`` read of 8 KiB runs every
32 KiB (one column shard's rows), and fio's sequential O_DIRECT read at 1,
4 and 16 MiB (iodepth 16) for the device's best.  GB/s, best of ``--reps``.
This is the measurement behind the reader's request-size rule
(docs/NATIVE.md, "Request sizes").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from fp_dcp.options import parse_size  # noqa: E402

CONFIGS = [(256 << 10, 64), (1 << 20, 16), (1 << 20, 32), (4 << 20, 4), (4 << 20, 8), (4 << 20, 16)]


def read_once(path: str, nbytes: int, block: int, qd: int, mode: str, checksums: bool) -> float:
    from fp_dcp import _native

    with _native.Engine("aio", queue_depth=qd, block_size=block) as eng:
        if mode == "scatter":
            run, stride = 8 << 10, 32 << 10
            n = min(nbytes, 256 << 20) // stride
            buf = _native.AlignedBuffer(n * run + 4096, 4096, lock=False)
            offs = np.arange(n, dtype=np.int64) * stride
            views = [memoryview(buf)[64 + i * run: 64 + (i + 1) * run] for i in range(n)]
            moved = n * run
        else:
            buf = _native.AlignedBuffer(nbytes + 4096, 4096, lock=False)
            np.frombuffer(buf, np.uint8)[::4096] = 1  # fault the destination in: a state dict is
            delta = 64 if mode == "torch" else 0
            pieces = max(1, nbytes // (64 << 20))  # 64 MiB tensors
            size = nbytes // pieces
            offs = np.arange(pieces, dtype=np.int64) * size
            views = [memoryview(buf)[delta + i * size: delta + (i + 1) * size] for i in range(pieces)]
            moved = pieces * size
        kw = {"checksums": 1 << 20} if checksums else {}
        fd = eng.open(path, "r", True)
        try:
            C.drop_caches()
            t0 = time.perf_counter()
            eng.read([fd], [path], np.zeros(len(views), np.int64), offs, views, **kw)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        for v in views:
            v.release()
        buf.close()
    return moved / dt / 1e9


def main() -> int:
    ap = C.parser(__doc__, "sweep_requests", size="1GiB", size_help="the file read in every configuration",
                  profiles="bare,throttled", json_help="write the results here", child=False,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--configs", default=",".join(f"{b >> 10}Kx{q}" for b, q in CONFIGS),
                    help="engine shapes, e.g. 256Kx64,4096Kx8")
    ap.add_argument("--modes", default="torch,zc,scatter")
    ap.add_argument("--no-fio", action="store_true")
    args = ap.parse_args()
    names = C.check_profiles(ap, args.profiles)
    with C.Bench("sweep_requests", args) as bench:
        return _run(args, bench, [C.DeviceProfile(name, bench.target, args.throttle_iops) for name in names])


def _run(args, bench: C.Bench, profiles: list[C.DeviceProfile]) -> int:
    nbytes = parse_size(args.size)
    path = str(bench.make_workdir() / "data.bin")
    from fp_dcp import _native

    rows, report = [], {"benchmark": "sweep_requests", "size_bytes": nbytes, "hardware": C.hardware_info(bench.target),
                        "profiles": [p.describe() for p in profiles], "results": []}
    src = _native.AlignedBuffer(64 << 20, 4096, lock=False)
    np.frombuffer(src, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    with _native.Engine("aio") as eng:
        fd = eng.open(path, "w", True)
        try:
            n = nbytes // (64 << 20)
            eng.write([fd], [path], np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * (64 << 20), [src] * n)
        finally:
            os.close(fd)
    src.close()
    for prof in C.entered(profiles):
        name = prof.name
        print(f"== {prof.label()}", flush=True)
        for bs in () if args.no_fio else ("1M", "4M", "16M"):
            best = 0.0
            for _ in range(args.reps):
                C.drop_caches()
                r = C.raw_device_io("read", path, nbytes, "fio", parse_size(bs), 16)
                best = max(best, r["bytes"] / r["seconds"] / 1e9)
            rows.append([name, f"fio {bs} qd16", "seq", f"{best:.2f}"])
            report["results"].append({"profile": name, "what": f"fio {bs} qd16", "gbps": best})
            print("  ", rows[-1], flush=True)
        configs = [(parse_size(c.split("x")[0]), int(c.split("x")[1])) for c in args.configs.split(",")]
        for block, qd in configs:
            for mode, ck in ((m, True) for m in args.modes.split(",")):
                g = max(read_once(path, nbytes, block, qd, mode, ck) for _ in range(args.reps))
                label = f"engine {block >> 10}K x {qd}"
                rows.append([name, label, mode + (" +crc" if ck else ""), f"{g:.2f}"])
                report["results"].append({"profile": name, "block": block, "qd": qd, "mode": mode,
                                          "checksums": ck, "gbps": g})
                print("  ", rows[-1], flush=True)
    text = C.format_table(["profile", "config", "read", "GB/s"], rows)
    print(text)
    report["table"] = text
    if args.json:
        bench.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
