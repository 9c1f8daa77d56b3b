"""fp_dcp demo: the raw device, then save, async-save and reshard-load a
generated model with fp_dcp beside the stock FileSystemWriter / Reader, in one
run on this machine, with the ratios.

    python tools/demo.py [--size 512MiB] [--ranks 2] [--dir DIR] [--keep]

Steps, printed in the order they run (progress on stderr, results on stdout):

1. The device with no checkpoint format: a sequential O_DIRECT write and read
   of a scratch file with fp_dcp's native engine (fp_dcp._aio) into one
   aligned buffer, 1, 4 and 16 MiB requests; the best of each is the
   reference ("raw") for the ratios.  fio, when on PATH, is run too and counts
   if it is faster.
2. --ranks gloo processes each hold a Shard(0) slice of every parameter
   (DTensor) and dcp.save the model: fp_dcp, then stock.  fp_dcp's line is
   split into the bytes' transfer (each rank's write_data, to durable files)
   and the fixed cost of a checkpoint (DCP's planning, the metadata, the
   commit), which does not grow with the model.
3. The same processes dcp.async_save with fp_dcp twice: the time until
   async_save returns, until training may change the weights again, and until
   the checkpoint is committed.  The first one also allocates the staging
   memory (first touch of every page); a training loop pays that once, so the
   second is what each later checkpoint costs.
4. One process without a process group loads the sharded checkpoint into
   whole tensors (a resharded restart), cold (page cache dropped when run as
   root), fp_dcp then stock, and compares every tensor bit for bit.  fp_dcp
   also checks the CRC-32C of every block it reads; stock checks nothing.
   fp_dcp's line is split the same way (read_data against the rest).

Everything goes into a new directory under the system's temporary directory
($TMPDIR, else /tmp), or into --dir DIR; the demo says how much it will write
before it starts and writes nowhere else.  At the end it deletes all it wrote
(never anything it did not write) unless --keep: then the four checkpoints
stay, and you can try fp-dcp inspect DIR/fp, fp-dcp verify DIR/fp.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp_dcp.options import format_size, parse_size  # noqa: E402

MiB = 1 << 20
RAW_REQUESTS = (1 * MiB, 4 * MiB, 16 * MiB)
RAW_IN_FLIGHT = 64 * MiB  # queue depth x request size of the raw runs
RAW_MAX_BYTES = 512 * MiB  # the raw runs' file: the model's size, at most this


_T0 = [time.time()]  # wall clock at the start (the ranks get the parent's)


def say(msg: str) -> None:
    """Progress: stderr, at once, with the seconds since the demo started."""
    print(f"[demo {time.time() - _T0[0]:5.1f} s] {msg}", file=sys.stderr, flush=True)


def out(msg: str = "") -> None:
    print(msg, flush=True)


CHECKPOINTS = ("fp", "stock", "fp_async_first", "fp_async_steady")


def model_shape(total_bytes: int) -> tuple[int, int, int, int]:
    """(hidden, layers, tensors, bytes) of make_model(total_bytes), without torch."""
    hidden = 2048
    while hidden > 64 and 54 * hidden * hidden > total_bytes // 4:
        hidden //= 2
    nbytes, layers = 16 * hidden * hidden, 0  # the embedding
    while nbytes < total_bytes:
        nbytes += 38 * hidden * hidden + 4 * hidden  # float32 qkv, up, norm; bfloat16 out, down
        layers += 1
    return hidden, layers, 1 + 5 * layers, nbytes


def make_model(total_bytes: int):
    """A transformer-shaped stack of float32 / bfloat16 parameters, seeded;
    hidden 2048 from 1 GiB up, smaller for small sizes (a quick run)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    hidden, layers, _, _ = model_shape(total_bytes)
    sd = {"embed.weight": torch.randn(4 * hidden, hidden, generator=g)}
    for layer in range(layers):
        p = f"layers.{layer}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        sd[p + "attn.out.weight"] = torch.randn(hidden, hidden, generator=g).to(torch.bfloat16)
        sd[p + "mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        sd[p + "mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=g).to(torch.bfloat16)
        sd[p + "norm.weight"] = torch.ones(hidden)
    return sd


# ------------------------------------------------------------------ the device


def measure_raw(directory: str, nbytes: int) -> dict:
    """Best sequential O_DIRECT write and read of ``nbytes`` (GB/s) over
    RAW_REQUESTS, with fp_dcp's engine into one aligned buffer (the
    measurement of ``fp-dcp tune``: fp_dcp.tools.tune.engine_pass), and fio if
    on PATH.  Returns {"write": (gbps, how), "read": (gbps, how), "runs": [...]}."""
    from fp_dcp import _native
    from fp_dcp.tools.tune import engine_pass, fill_random

    path = os.path.join(directory, "raw-device-test.bin")  # in the demo's own scratch directory
    nbytes = -(-nbytes // max(RAW_REQUESTS)) * max(RAW_REQUESTS)
    direct = _native.direct_io_supported(directory)
    buf = _native.AlignedBuffer(min(nbytes, 128 * MiB), 4096)
    fill_random(buf)
    runs = []
    try:
        for bs in RAW_REQUESTS:
            qd = max(1, RAW_IN_FLIGHT // bs)
            for op in ("write", "read"):
                say(f"raw device {op}: {format_size(nbytes)} in {bs // MiB} MiB requests x {qd} in flight"
                    f"{'' if direct else ' (buffered: the file system refuses O_DIRECT)'} ...")
                r = engine_pass(op, path, nbytes, bs, qd, buffer=buf, direct=direct)
                runs.append((op, f"{r['kind']} {bs // MiB} MiB x {qd}", nbytes / r["seconds"] / 1e9))
        runs += _fio(path, nbytes)
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    best = {}
    for op in ("write", "read"):
        gbps, how = max((g, h) for o, h, g in runs if o == op)
        best[op] = (gbps, how)
    return {**best, "runs": runs, "bytes": nbytes, "direct": direct}


def _fio(path: str, nbytes: int) -> list[tuple[str, str, float]]:
    import json

    fio = shutil.which("fio")
    if fio is None:
        return []
    runs = []
    for bs in RAW_REQUESTS:
        for op in ("write", "read"):
            say(f"raw device {op} with fio: {bs // MiB} MiB requests ...")
            cmd = [fio, "--name=raw", f"--filename={path}", f"--rw={op}", f"--bs={bs}", f"--size={nbytes}",
                   f"--iodepth={max(1, RAW_IN_FLIGHT // bs)}", "--ioengine=libaio", "--direct=1",
                   "--output-format=json"] + (["--end_fsync=1"] if op == "write" else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                say(f"fio failed, left out: {p.stderr.strip()[-200:]}")
                return runs
            job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0][op]
            runs.append((op, f"fio {bs // MiB} MiB x {max(1, RAW_IN_FLIGHT // bs)}", job["bw_bytes"] / 1e9))
    return runs


# ------------------------------------------------------------------ the saving ranks


def _rank_main(rank: int, world: int, init_file: str, size: int, root: str, queue, t0: float) -> None:
    _T0[0] = t0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistWriter

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_model(size).items()}
    sd = {"model": model, "step": 100}

    def step(msg):
        if rank == 0:
            say(msg)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    writer = FastPersistWriter()
    step(f"dcp.save with fp_dcp ({world} ranks) ...")
    sec = timed(lambda: dcp.save(sd, storage_writer=writer, checkpoint_id=os.path.join(root, "fp")))
    moving = [0.0] * world  # each rank's write_data: its bytes written and made durable
    dist.all_gather_object(moving, writer.last_stats.get("seconds", 0.0))
    if rank == 0:
        queue.put(("save", "fp_dcp", sec, writer.last_stats.get("engine"), max(moving)))
    step(f"dcp.save with the stock FileSystemWriter ({world} ranks) ...")
    sec = timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(root, "stock"))))
    if rank == 0:
        queue.put(("save", "stock", sec, None, None))

    marks = {}

    def async_round(name):
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, storage_writer=writer, checkpoint_id=os.path.join(root, name))
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        marks["returned"] = time.perf_counter() - t0
        if staging is not None:
            staging.result()
        marks["staged"] = time.perf_counter() - t0
        upload.result()

    for which in ("first", "steady"):
        step(f"dcp.async_save with fp_dcp, {which} ...")
        total = timed(lambda: async_round(f"fp_async_{which}"))
        if rank == 0:
            queue.put(("async", which, total, dict(marks)))
    writer.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(("done",))


# ------------------------------------------------------------------ main


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _raw_bytes(nbytes: int) -> int:
    """The raw runs' test file for a model of ``nbytes``."""
    return -(-min(nbytes, RAW_MAX_BYTES) // max(RAW_REQUESTS)) * max(RAW_REQUESTS)


def _planned(nbytes: int) -> int:
    """What the demo writes at most at once: its four checkpoints and the raw test file."""
    return 4 * nbytes + _raw_bytes(nbytes)


def _split(nbytes: int, total: float, moving: float, raw: float, op: str) -> str:
    """The bytes' transfer apart from the fixed cost of one checkpoint."""
    gbps = nbytes / moving / 1e9 if moving > 0 else 0.0
    return (f"    of which moving the bytes {moving:6.2f} s  {gbps:6.2f} GB/s  {_ratio(gbps, raw)} raw {op}; "
            f"fixed cost per checkpoint (DCP's planning, metadata, commit) {max(0.0, total - moving):.2f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512MiB",
                    help="model bytes (default 512MiB: under a minute on 2 cores; rounded up to whole layers)")
    ap.add_argument("--ranks", type=int, default=2, help="processes saving the sharded model (default 2)")
    ap.add_argument("--dir", default=None,
                    help="write into DIR (created if missing) instead of a new directory under the system's "
                         "temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the four checkpoints at the end")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    created = args.dir is None or not os.path.exists(args.dir)
    if args.dir is not None:
        root = os.path.abspath(args.dir)
        clash = [n for n in CHECKPOINTS if os.path.lexists(os.path.join(root, n))]
        if clash:
            sys.exit(f"demo: {root} already holds {', '.join(clash)}; give an empty or new --dir "
                     f"(the demo never deletes what it did not write)")
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="fp_dcp_demo_")
    t_start = _T0[0]
    _, _, _, nbytes = model_shape(size)
    say(f"writing under {root}: about {format_size(_planned(nbytes))} (4 checkpoints of "
        f"{format_size(nbytes)} and a {format_size(_raw_bytes(nbytes))} test file), "
        + ("the checkpoints kept at the end (--keep)" if args.keep else "all removed at the end (--keep keeps them)"))
    # the raw device test file and the ranks' rendezvous: in a directory of
    # the demo's own, on the same file system, always removed
    scratch = tempfile.mkdtemp(prefix=".fp_dcp_demo_scratch_", dir=root)
    # torch creates a cache directory of its compiler on import (under the
    # temporary directory): in the scratch directory, unless one is set
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(scratch, "torchinductor"))
    try:
        return _run(args, size, root, scratch, args.keep, t_start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            for name in CHECKPOINTS:  # only what this run wrote: --dir held none of them
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            if created:
                shutil.rmtree(root, ignore_errors=True)


def _run(args, size: int, root: str, scratch: str, keep: bool, t_start: float) -> int:
    import multiprocessing as mp
    import warnings

    say("importing torch ...")
    import torch
    import torch.distributed.checkpoint as dcp

    import fp_dcp
    from fp_dcp import FastPersistReader

    warnings.simplefilter("ignore")
    say(f"generating the model (--size {format_size(size)}, rounded up to whole layers) ...")
    model = make_model(size)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    out(f"fp_dcp {fp_dcp.__version__} demo: a {format_size(nbytes)} model ({len(model)} tensors + 1 other item), "
        f"under {root}")
    out(f"writes about {format_size(_planned(nbytes))} there, "
        + ("keeps the checkpoints (--keep)" if keep else "removes it all at the end (--keep keeps the checkpoints)"))
    out("GB/s = 10^9 bytes of tensors per second; ratios: against the raw device and the stock writer/reader\n")

    # 1. the device
    raw = measure_raw(scratch, _raw_bytes(nbytes))
    out(f"raw device, no checkpoint format ({format_size(raw['bytes'])} sequential, "
        f"{'O_DIRECT' if raw['direct'] else 'buffered'}), in the order run:")
    for op in ("write", "read"):
        cells = "   ".join(f"{how}: {g:.2f}" for o, how, g in raw["runs"] if o == op)
        out(f"  raw {op:<5}  {cells}   best {raw[op][0]:.2f} GB/s")
    raw_w, raw_r = raw["write"][0], raw["read"][0]

    # 2., 3. the saving ranks
    say(f"starting {args.ranks} ranks (gloo), each generating the model ...")
    # forkserver: fresh single-threaded processes forked from a server that
    # imported torch once (spawn would import it in every rank)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "fp_dcp.save.writer"])
    queue = ctx.Queue()
    init_file = os.path.join(scratch, "rendezvous")
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, init_file, size, root, queue, _T0[0]))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    saves = {}
    out(f"\ndcp.save, {args.ranks} ranks, Shard(0) DTensors, in the order run:")
    while True:
        try:
            msg = queue.get(timeout=5)
        except Exception:  # queue.Empty: is everyone still alive?
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                out(f"a saving rank failed (exit code {dead[0].exitcode}); see its error above")
                return 1
            continue
        if msg[0] == "done":
            break
        if msg[0] == "save":
            _, name, sec, engine, moving = msg
            saves[name] = sec
            gbps = nbytes / sec / 1e9
            label = f"fp_dcp FastPersistWriter ({engine})" if name == "fp_dcp" else "stock  FileSystemWriter"
            out(f"  {label:<34} {sec:6.2f} s  {gbps:6.2f} GB/s  {_ratio(gbps, raw_w)} raw write")
            if moving is not None:
                out(_split(nbytes, sec, moving, raw_w, "write"))
            if name == "stock":
                out(f"  fp_dcp saves at {_ratio(saves['stock'], saves['fp_dcp'])} the stock writer's speed")
                out("\ndcp.async_save with fp_dcp (staging=eager), in the order run:")
        elif msg[0] == "async":
            _, which, total, marks = msg
            note = "  (allocates the staging memory: once per writer)" if which == "first" else ""
            out(f"  {which:<6} returned after {marks['returned'] * 1e3:7.1f} ms; training may step after "
                f"{marks['staged'] * 1e3:7.1f} ms; committed after {total:6.2f} s{note}")
    say("the ranks are exiting ...")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            out(f"a saving rank failed (exit code {p.exitcode})")
            return 1

    # 4. resharded loads
    out(f"\nresharded load, {args.ranks} ranks' Shard(0) slices -> whole tensors in 1 process, "
        f"{'cold (page cache dropped)' if os.geteuid() == 0 else 'WARM (not root: page cache not dropped)'}, "
        f"in the order run:")
    loads = {}
    for name, label, reader in [
        ("fp_dcp", "fp_dcp FastPersistReader", FastPersistReader(os.path.join(root, "fp"))),
        ("stock", "stock  FileSystemReader", dcp.FileSystemReader(os.path.join(root, "stock"))),
    ]:
        target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "step": 0}
        if os.geteuid() == 0:
            say("dropping the page cache ...")
            subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, stderr=subprocess.DEVNULL)
        say(f"dcp.load with {label.split()[-1]} ...")
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        sec = time.perf_counter() - t0
        loads[name] = sec
        say("comparing every tensor bit for bit ...")
        ok = target["step"] == 100 and all(torch.equal(target["model"][k], v) for k, v in model.items())
        gbps = nbytes / sec / 1e9
        checked = "  every block's CRC-32C checked" if name == "fp_dcp" else ""
        out(f"  {label:<34} {sec:6.2f} s  {gbps:6.2f} GB/s  {_ratio(gbps, raw_r)} raw read   "
            f"{'bit-exact' if ok else 'MISMATCH'}{checked}")
        if name == "fp_dcp":
            out(_split(nbytes, sec, reader.last_stats.get("seconds", 0.0), raw_r, "read"))
        if not ok:
            return 1
    out(f"  fp_dcp loads at {_ratio(loads['stock'], loads['fp_dcp'])} the stock reader's speed")

    out(f"\ndone in {time.time() - t_start:.0f} s.")
    fp_dir = os.path.join(root, "fp")
    if keep:
        out(f"kept: {root} (fp/, stock/, fp_async_first/, fp_async_steady/)")
        out(f"next: fp-dcp inspect {fp_dir}, fp-dcp verify {fp_dir}")
    else:
        out(f"removing what it wrote under {root}; to look inside a checkpoint, run again with --keep, "
            f"then: fp-dcp inspect DIR/fp, fp-dcp verify DIR/fp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
