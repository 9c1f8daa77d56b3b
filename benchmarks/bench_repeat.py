"""Checkpointing again and again in one process, each save through a new writer.

    flock /tmp/fp_dcp_bench.lock python benchmarks/bench_repeat.py [--size 1GiB] [--mix small] [--saves 6]
        [--interval 5] [--profiles bare,throttled]

A training job saves every N steps to a new path, usually through a new
writer each time.  Each saving contender is one long-lived process (a
training process) that builds the state dict (``--mix``, as
``bench_save_load.py`` builds it) once, then saves it ``--saves`` times,
each save through a new writer into a new directory after a pause
(``--interval``), the contenders taking turns save by save:

* ``fp_dcp``: ``FastPersistWriter`` with default options: a closed writer's
  engine leaves its settled bounce buffers to the next writer's;
* ``fp_dcp[keep 0]``: the same in a process with
  ``FP_DCP_KEEP_BOUNCE_BUFFERS=0``: each writer's engine faults its bounce
  buffers in (and locks them) anew;
* ``stock``: DCP's ``FileSystemWriter`` (one thread);
* ``raw``: the same number of bytes written by fp_dcp's engine from one
  huge-page buffer (4 MiB x 8), once per turn (in this process).

Per contender it prints the first save, the median and range of the later
ones and their ratio to raw; for fp_dcp, also the time its engine calls
spent outside the I/O pipeline (waiting for the bounce buffers' first touch).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from fp_dcp.options import parse_size  # noqa: E402

CONTENDERS = ("fp_dcp", "fp_dcp[keep 0]", "stock", "raw")


def main() -> int:
    p = C.parser(__doc__.split("\n\n")[0], "repeat", size="1GiB", size_help="bytes of tensors per save",
                 quick="smoke test: 64 MiB, 3 saves", seed="the state dict's seed", profiles="bare",
                 json_help="write the results here", child=False)
    p.add_argument("--mix", choices=("small", "large"), default="small")
    p.add_argument("--saves", type=int, default=6, help="saves per contender (at least 2)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds of pause before each save (a job saves minutes apart: memory freed in between "
                        "may go back to the host, as with a VM's free-page reporting)")
    args = p.parse_args()
    if args.quick:
        args.size, args.saves, args.interval = "64MiB", 3, min(args.interval, 3.0)
    if args.saves < 2:
        p.error("--saves must be at least 2: the first save and the later ones are reported apart")
    nbytes = parse_size(args.size)
    profiles = [C.DeviceProfile(n, args.dir or C.DEFAULT_DIR, args.throttle_iops, fs_bytes=3 * nbytes + C.GiB,
                                run_bytes=nbytes) for n in C.check_profiles(p, args.profiles)]
    with C.Bench("repeat", args) as bench:
        work = bench.make_workdir(need_bytes=3 * nbytes)
        hw = bench.hardware()
        runs, skipped = {}, []
        for prof in C.entered(profiles, skipped):
            print(f"\n== device profile: {prof.label()}")
            runs[prof.name] = _run(args, prof.directory or work, nbytes)
        for line in skipped:
            print(line)
        if args.json:
            bench.write(bench.report(size=nbytes, mix=args.mix, saves=args.saves, runs=runs,
                                     profiles=[p.describe() for p in profiles], hardware=hw))
    return 0


def _run(args, work: Path, nbytes: int) -> dict:
    import subprocess

    import fp_dcp.engine as engine

    savers = {}
    try:
        for name in CONTENDERS[:3]:
            env = dict(os.environ)
            if name == "fp_dcp[keep 0]":
                env[engine.KEEP_BOUNCE_BUFFERS_ENV] = "0"
            spec = {"contender": name, "mix": args.mix, "size": nbytes, "seed": args.seed}
            savers[name] = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = {name: _answer(proc) for name, proc in savers.items()}
        payload = ready["fp_dcp"]["payload"]
        times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        waits: dict[str, list[float]] = {c: [] for c in CONTENDERS[:2]}
        for i in range(args.saves):
            for name in CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]:
                d = work / f"{name.replace(' ', '_').replace('[', '_').replace(']', '')}-{i}"
                time.sleep(args.interval)
                if name == "raw":
                    d.mkdir()
                    os.sync()
                    r = C.raw_device_io("write", d / "raw.bin", payload, method="hugebuf",
                                        block_size=4 << 20, iodepth=8)
                    times[name].append(r["seconds"] * payload / r["bytes"])  # (rounded up to whole blocks)
                else:
                    savers[name].stdin.write(f"{d}\n")
                    savers[name].stdin.flush()
                    r = _answer(savers[name])
                    times[name].append(r["seconds"])
                    if name in waits:
                        waits[name].append(r["engine_wait"])
                shutil.rmtree(d, ignore_errors=True)
            print(f"save {i + 1}/{args.saves}: " + ", ".join(f"{c} {times[c][-1]:.3f} s" for c in CONTENDERS),
                  file=sys.stderr)
    finally:
        for proc in savers.values():
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(timeout=60)
    raw_later = statistics.median(times["raw"][1:])
    rows = []
    for c in CONTENDERS:
        later = times[c][1:]
        med = statistics.median(later)
        wait = (f"{waits[c][0] * 1e3:.1f} / {statistics.median(waits[c][1:]) * 1e3:.1f} "
                f"({min(waits[c][1:]) * 1e3:.1f}-{max(waits[c][1:]) * 1e3:.1f})" if c in waits else "")
        rows.append([c, f"{times[c][0]:.3f}", f"{med:.3f}", f"{min(later):.3f}-{max(later):.3f}",
                     f"{payload / med / 1e9:.2f}", f"{raw_later / med:.2f}x", wait])
    print(C.format_table(["contender", "first save s", "later saves s (median)", "later range s", "GB/s",
                          "x raw", "engine wait ms: first / later median (range)"], rows))
    print(f"{C.fmt_size(payload)} of tensors ({args.mix} mix, {ready['fp_dcp']['entries']} entries), "
          f"{args.saves} saves each, {args.interval:g} s apart")
    return {"times": times, "engine_wait": waits, "payload": payload, "entries": ready["fp_dcp"]["entries"]}


def _answer(proc) -> dict:
    """The saver's next result line (its error, raised, when it died)."""
    for line in proc.stdout:
        if line.startswith(C.RESULT_MARKER):
            return json.loads(line[len(C.RESULT_MARKER):])
    raise RuntimeError(f"a saver process ended (exit code {proc.wait()}) before answering")


def _saver(spec_json: str) -> None:
    """A contender's process: build the state dict, then save it into each
    directory named on stdin, each time through a new writer."""
    spec = json.loads(spec_json)
    C.import_fp_dcp()
    import torch.distributed.checkpoint as dcp

    import fp_dcp.engine as engine
    from fp_dcp import FastPersistWriter

    sd = C.StateDictFactory(C.make_spec(spec["mix"], spec["size"], spec["seed"])).build(zero=False)
    payload = sum(v.numel() * v.element_size() for v in sd.values() if hasattr(v, "element_size"))
    outside: list[float] = []
    real = engine.IOSession.write_fds

    def timed(self, *a, **kw):  # an engine call's time outside its I/O pipeline
        t0 = time.perf_counter()
        out = real(self, *a, **kw)
        outside.append(time.perf_counter() - t0 - out["seconds"])
        return out

    engine.IOSession.write_fds = timed
    C.emit_result({"payload": payload, "entries": len(sd)})
    for line in sys.stdin:
        d = line.strip()
        os.sync()
        outside.clear()
        if spec["contender"] == "stock":
            writer = dcp.FileSystemWriter(d, thread_count=1, sync_files=True)
        else:
            writer = FastPersistWriter(d)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer)
        seconds = time.perf_counter() - t0
        if spec["contender"] != "stock":
            writer.close()
        C.emit_result({"seconds": seconds, "engine_wait": sum(outside)})


if __name__ == "__main__":
    sys.exit(C.main(_saver, lambda argv: main()))
