"""Measure fp_dcp._aio write and read throughput over block sizes and queue depths.

    python benchmarks/tune_engine.py --dir /work/tune --size 2G --reps 2 --json bench_out/tune.json

For each engine, block size and queue depth: write a `--size` file from one
source buffer and read it back into one destination, each twice over:
"zc" uses page-aligned memory (the zero-copy path: requests go straight
from/to the caller's memory), "copy" an address off by one byte (every byte
goes through the engine's bounce buffers). Writes include the final
fdatasync; reads start from a cold page cache (drop_caches, root only) on an
O_DIRECT fd. Each result is checked against the source before its speed
counts. Prints a markdown table of GB/s (best of --reps) and the best
configuration per column.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from fp_dcp import _native
from fp_dcp.options import parse_size

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def machine():
    info = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        info["fs"] = subprocess.run(["findmnt", "-no", "FSTYPE,SOURCE", "-T", ARGS.dir],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def one(kind, bs, qd, mode, src, dst, path, cold):
    """(write GB/s, read GB/s) for one configuration and memory mode."""
    size = len(src)
    with _native.Engine(kind, queue_depth=qd, block_size=bs, read_queue_depth=qd,
                     read_block_size=bs) as eng:
        fd = eng.open(path, "w", direct=True)
        try:
            w = eng.write([fd], [path], [0], [0], [src], sync=True)
        finally:
            os.close(fd)
        if cold:
            drop_caches()
        fd = eng.open(path, "r", direct=True)
        try:
            r = eng.read([fd], [path], [0], [0], [dst])
        finally:
            os.close(fd)
    # check the bytes before the speed counts (a sample of pages, all of them would take longer than the I/O)
    step = max(1, size // 4096)
    if not np.array_equal(src[::step], dst[::step]) or not np.array_equal(src[-4096:], dst[-4096:]):
        raise SystemExit(f"{kind} bs={bs} qd={qd} {mode}: read back differs from what was written")
    zc = w["zero_copy_bytes"] if mode == "zc" else r["direct_bytes"]
    return size / w["seconds"] / 1e9, size / r["seconds"] / 1e9, zc


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/tune", help="directory on the file system to measure")
    ap.add_argument("--size", default="2G")
    ap.add_argument("--blocks", default="512K,1M,2M,4M,8M")
    ap.add_argument("--qds", default="4,8,16,32")
    ap.add_argument("--engines", default="aio,uring")
    ap.add_argument("--modes", default="zc,copy")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None, help="write all samples here")
    ARGS = ap.parse_args()
    os.makedirs(ARGS.dir, exist_ok=True)
    size = parse_size(ARGS.size)
    blocks = [parse_size(b) for b in ARGS.blocks.split(",")]
    qds = [int(q) for q in ARGS.qds.split(",")]
    engines = [e for e in ARGS.engines.split(",") if e in _native.available_engines()]
    modes = ARGS.modes.split(",")
    cold = drop_caches()
    if not cold:
        print("note: cannot drop caches (not root): reads may be warm", file=sys.stderr)

    # one source and one destination for every run: fresh memory costs page faults, not I/O
    src_buf = _native.AlignedBuffer(size + 4096)
    dst_buf = _native.AlignedBuffer(size + 4096)
    src_all = np.frombuffer(src_buf, np.uint8)
    src_all[:] = np.random.default_rng(0).integers(0, 256, size + 4096, dtype=np.uint8)
    dst_all = np.frombuffer(dst_buf, np.uint8)
    views = {"zc": (src_all[:size], dst_all[:size]), "copy": (src_all[1:size + 1], dst_all[1:size + 1])}
    path = os.path.join(ARGS.dir, "tune.bin")

    samples = []
    t_start = time.time()
    for rep in range(ARGS.reps):
        for kind in engines:
            for bs in blocks:
                for qd in qds:
                    for mode in modes:
                        src, dst = views[mode]
                        dst[:] = 0
                        w, r, zc = one(kind, bs, qd, mode, src, dst, path, cold)
                        samples.append({"engine": kind, "block_size": bs, "queue_depth": qd, "mode": mode,
                                        "rep": rep, "write_GBps": w, "read_GBps": r, "zero_copy_bytes": zc})
                        print(f"rep {rep} {kind:5s} bs={bs // KIB:5d}K qd={qd:3d} {mode:4s} "
                              f"write {w:5.2f} GB/s  read {r:5.2f} GB/s", flush=True)
    os.unlink(path)

    best = {}
    for s in samples:
        key = (s["engine"], s["block_size"], s["queue_depth"], s["mode"])
        b = best.setdefault(key, {"write": 0.0, "read": 0.0})
        b["write"] = max(b["write"], s["write_GBps"])
        b["read"] = max(b["read"], s["read_GBps"])

    cols = [(kind, mode) for kind in engines for mode in modes]
    print(f"\nGB/s, best of {ARGS.reps}, {size / GIB:g} GiB file, {machine()}; "
          f"write incl. fdatasync / cold O_DIRECT read\n")
    print("| block | qd | " + " | ".join(f"{k} {m} write | {k} {m} read" for k, m in cols) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(cols)))
    for bs in blocks:
        for qd in qds:
            cells = []
            for kind, mode in cols:
                b = best[(kind, bs, qd, mode)]
                cells += [f"{b['write']:.2f}", f"{b['read']:.2f}"]
            print(f"| {bs // KIB}K | {qd} | " + " | ".join(cells) + " |")
    print()
    for kind, mode in cols:
        for op in ("write", "read"):
            (k, bs, qd, m), b = max(((key, b) for key, b in best.items() if key[0] == kind and key[3] == mode),
                                    key=lambda kv: kv[1][op])
            print(f"best {op:5s} {kind} {mode}: {b[op]:.2f} GB/s at block {bs // KIB}K qd {qd}")
    print(f"\n{len(samples)} runs in {time.time() - t_start:.0f} s")
    if ARGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.json)), exist_ok=True)
        with open(ARGS.json, "w") as fh:
            json.dump({"machine": machine(), "size": size, "samples": samples}, fh, indent=1)
    src_buf, dst_buf = None, None


if __name__ == "__main__":
    main()
