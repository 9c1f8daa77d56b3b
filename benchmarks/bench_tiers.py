"""Multi-tier checkpointing: the cost per training iteration and
the recovery time of ``fp_dcp.TierManager``, against no checkpointing and
stock ``dcp.async_save`` to the persistent path.

4 gloo ranks on this machine act as 2 nodes (``ranks_per_node=2``), an
FSDP2 model (``--layers`` Linear layers of ``--width``) with AdamW.  The
persistent tier is an ext4 file system on a loop device, throttled like a
shared file system (cgroup v1 blkio ``throttle.{read,write}_bps_device`` on
the loop device, ``--throttle-mbps``), set up and torn down here as root;
the local tier is the bare disk (``--dir``).  Where the loop device or the
cgroup cannot be set up the run says so and uses an unthrottled directory.

Runs, each ``--iters`` iterations (``--persist-every`` divides it):

* ``none``: no checkpointing;
* ``tiers``: every step to the local tier + ``--replicas`` replica,
  drained every ``--persist-every`` steps (lazy staging);
* ``stock``: ``dcp.async_save`` with the stock ``FileSystemWriter`` to the
  persistent tier every ``--persist-every`` steps (own gloo group, the
  previous save awaited before the next: torchtitan's pattern);

then node 1 is lost (its local directory deleted) and 4 fresh ranks
restore the last step ``--repeat`` times each way, alternating: through
``TierManager.restore`` (local tier and replicas; timed from before the
manager is built) and with ``dcp.load`` + ``FastPersistReader`` straight
from the throttled persistent tier, page cache dropped before each.  Each
restore's time is its slowest rank's; the report gives each round's ratio.

State size: ``--state-mb`` sets the layer count whose fp32 parameters and
AdamW moments come nearest (3 x 4 bytes x (width² + width) a layer); the
report gives that and the checkpoint's bytes on disk.  The tiers' fixed
costs (groups, agreement, planning) do not grow with the state, the
persistent tier's time does: measure recovery at a size where the tiers'
throughput matters (``--state-mb 1000``).  ``--recovery-only`` skips the
iteration comparison: one tiers run saves the checkpoint, then the
restores.

    flock /tmp/fp_dcp_bench.lock python benchmarks/bench_tiers.py --json bench_out/tiers.json
    flock /tmp/fp_dcp_bench.lock python benchmarks/bench_tiers.py --recovery-only --state-mb 1000 \
        --batch 16 --iters 10 --json bench_out/tiers_recovery.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DIR, drop_caches, format_table, timestamp, write_json  # noqa: E402

BLKIO = Path("/sys/fs/cgroup/blkio")
MODES = ("none", "tiers", "stock")
WORLD = 4


# ----------------------------------------------------------------- ranks

def _rank_main(rank, cfg, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, cfg["repo"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{cfg['rdv']}", rank=rank, world_size=WORLD)
        out = {"train": _train, "restore_tiers": _restore_tiers, "restore_persistent": _restore_persistent}[
            cfg["job"]](rank, cfg)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001
        queue.put((rank, False, traceback.format_exc()))


def _model(cfg, seed):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _train(rank, cfg):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model, opt = _model(cfg, 0)
    g = torch.Generator().manual_seed(rank)
    batch = [torch.randn(cfg["batch"], cfg["width"], generator=g) for _ in range(4)]
    mode = cfg["mode"]
    mgr = group = pending = None
    if mode == "tiers":
        from fp_dcp import TierManager

        mgr = TierManager(cfg["local"], cfg["persist"], replicas=cfg["replicas"],
                          persist_every=cfg["persist_every"], ranks_per_node=2, keep_local=2, keep_persistent=2,
                          background_nice=cfg.get("background_nice", 10))
    elif mode == "stock":
        group = dist.new_group(backend="gloo")
    times = []
    # the training thread's seconds per step in the checkpoint's calls: waiting for the
    # staging copy, making the state dict, and the save call (or async_save)
    waits: dict[str, list] = {"wait_staged": [], "state_dict": [], "save_call": []}
    cpu0, threads0 = time.process_time(), _thread_cpu()
    for step in range(1, cfg["iters"] + 1):
        if step == 3:  # the warm steps (those timed): no first-save allocations in their CPU
            warm0, warm_threads0 = time.process_time(), _thread_cpu()
        t0 = time.perf_counter()
        model(batch[step % 4]).pow(2).mean().backward()
        t1 = time.perf_counter()
        if mgr is not None:
            mgr.wait_staged()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = t4 = time.perf_counter()
        if mgr is not None:
            sd = _state(model, opt)
            t4 = time.perf_counter()
            mgr.save(step, sd)
            del sd
        elif mode == "stock" and step % cfg["persist_every"] == 0:
            sd = _state(model, opt)
            t4 = time.perf_counter()
            if pending is not None:
                pending.result()
            pending = dcp.async_save(sd, checkpoint_id=os.path.join(cfg["persist"], f"step_{step}"),
                                     storage_writer=dcp.FileSystemWriter(os.path.join(cfg["persist"], f"step_{step}")),
                                     process_group=group)
            del sd
        t5 = time.perf_counter()
        times.append(t5 - t0)
        waits["wait_staged"].append(t2 - t1)
        waits["state_dict"].append(t4 - t3)
        waits["save_call"].append(t5 - t4)
    warm = (time.process_time() - warm0) / (cfg["iters"] - 2)
    warm_threads = {k: (v - warm_threads0.get(k, 0.0)) / (cfg["iters"] - 2) for k, v in _thread_cpu().items()}
    t0 = time.perf_counter()
    threads1 = _thread_cpu()  # before close(): the background threads end there
    if mgr is not None:
        mgr.wait()
        threads1 = _thread_cpu()
        history = mgr.history
        mgr.close()
        errors = mgr.errors
    else:
        errors, history = [], {}
        if pending is not None:
            pending.result()
            threads1 = _thread_cpu()
    tail = time.perf_counter() - t0
    threads = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
    return {"times": times, "tail_seconds": tail, "errors": errors, "waits": waits,
            "cpu_seconds": time.process_time() - cpu0,  # every thread of this rank, the whole run and close()
            "thread_cpu_seconds": {k: v for k, v in threads.items() if v >= 0.005},
            # per warm step: from the start of step 3 to the end of the last (the background's
            # work on the last step and close() left out, that of step 2 in)
            "warm_cpu_seconds_per_step": warm,
            "warm_thread_cpu_seconds_per_step": {k: v for k, v in warm_threads.items() if v >= 0.0005},
            "history": {s: {k: v for k, v in h.items() if isinstance(v, (int, float))} for s, h in history.items()}}


def _thread_cpu() -> dict:
    """CPU seconds of this process's live threads, by Python thread name
    (the pool's number dropped) or "native" (gloo's, torch's, the engine's)."""
    import threading

    names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _restore_tiers(rank, cfg):
    from fp_dcp import TierManager

    model, opt = _model(cfg, 1)
    _warm(model, opt, cfg)
    sd = _state(model, opt)
    t0 = time.perf_counter()
    mgr = TierManager(cfg["local"], cfg["persist"], replicas=cfg["replicas"], persist_every=cfg["persist_every"],
                      ranks_per_node=2)
    built = time.perf_counter() - t0
    step = mgr.restore(sd)
    seconds = time.perf_counter() - t0
    res = mgr.last_restore
    mgr.close()
    return {"seconds": seconds, "step": step, "bytes_from": res.node_bytes_from, "skipped": res.skipped,
            "phases": {"manager": built, **res.phases}}


def _restore_persistent(rank, cfg):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    model, opt = _model(cfg, 1)
    _warm(model, opt, cfg)
    sd = _state(model, opt)
    t0 = time.perf_counter()
    dcp.load(sd, storage_reader=FastPersistReader(cfg["path"]))
    return {"seconds": time.perf_counter() - t0}


def _warm(model, opt, cfg):
    """One step, so that the optimizer has state to load into."""
    import torch

    model(torch.randn(2, cfg["width"])).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def run_job(cfg: dict, timeout: float = 1800) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        cfg = {**cfg, "rdv": os.path.join(d, "rdv")}
        procs = [ctx.Process(target=_rank_main, args=(r, cfg, queue), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(WORLD):
                rank, ok, value = queue.get(timeout=timeout)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed ({cfg['job']}):\n{value}")
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(WORLD)]


# ----------------------------------------------------- the persistent tier

class ThrottledTier:
    """An ext4 file system on a loop device under ``base``, mounted at
    ``base/mnt``, and a cgroup v1 blkio group limiting that device to
    ``mbps`` MB/s read and write, which this process (so its children)
    joins.  ``why`` says what could not be set up (then ``path`` is a plain
    directory)."""

    def __init__(self, base: Path, size: int, mbps: int) -> None:
        self.base, self.size, self.mbps = base, size, mbps
        self.image, self.mnt = base / "persist.img", base / "mnt"
        self.loop = self.group = None
        self.why = ""

    def __enter__(self) -> "ThrottledTier":
        self.mnt.mkdir(parents=True, exist_ok=True)
        try:
            if os.geteuid() != 0:
                raise PermissionError("not root")
            with open(self.image, "wb") as f:
                f.truncate(self.size)
            self.loop = subprocess.run(["losetup", "-f", "--show", str(self.image)], check=True,
                                       capture_output=True, text=True).stdout.strip()
            subprocess.run(["mkfs.ext4", "-q", "-F", self.loop], check=True, capture_output=True)
            subprocess.run(["mount", self.loop, str(self.mnt)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            self.why = f"no loop-mounted tier ({getattr(e, 'stderr', '') or e}); persistent tier unthrottled on the bare disk"
            self._umount()
            return self
        try:
            st = os.stat(self.loop)
            dev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            if not (BLKIO / "blkio.throttle.read_bps_device").exists():
                raise OSError("no cgroup v1 blkio throttling")
            self.group = BLKIO / f"fp_dcp_tiers_{os.getpid()}"
            self.group.mkdir(exist_ok=True)
            rate = self.mbps * 1_000_000
            (self.group / "blkio.throttle.read_bps_device").write_text(f"{dev} {rate}\n")
            (self.group / "blkio.throttle.write_bps_device").write_text(f"{dev} {rate}\n")
            (self.group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as e:
            self.why = f"loop device not throttled ({e})"
        return self

    @property
    def path(self) -> Path:
        return self.mnt

    def __exit__(self, *exc) -> None:
        if self.group is not None:
            try:
                (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")
            except OSError:
                pass
            for _ in range(50):
                try:
                    self.group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self._umount()

    def _umount(self) -> None:
        if self.loop:
            subprocess.run(["umount", str(self.mnt)], capture_output=True)
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        try:
            self.image.unlink()
        except FileNotFoundError:
            pass


def measure_tier(path: Path, nbytes: int = 256 << 20) -> dict:
    """MB/s of an O_DIRECT write and read of ``nbytes`` under ``path`` (dd)."""
    f = path / "probe.bin"
    out = {}
    for name, args in (("write", ["if=/dev/zero", f"of={f}", "oflag=direct"]),
                       ("read", [f"if={f}", "of=/dev/null", "iflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(["dd", *args, "bs=4M", f"count={nbytes >> 22}", "status=none"], check=True)
        out[f"{name}_mbps"] = nbytes / (time.perf_counter() - t0) / 1e6
    f.unlink()
    return out


# ------------------------------------------------------------------ main

def _layer_state_bytes(width: int) -> int:
    """Checkpointed bytes of one Linear(width, width): weight and bias in
    fp32, and AdamW's two moments of each (plus a scalar step per tensor,
    negligible)."""
    return (width * width + width) * 4 * 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR / "tiers", help="work directory (the local tier)")
    ap.add_argument("--layers", type=int, default=4, help="Linear layers of the model (see --state-mb)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--state-mb", type=float, default=None,
                    help="checkpointed state in MB (1e6 bytes): sets --layers to the count whose fp32 parameters and "
                         "AdamW's two moments come nearest (at least 1); the report gives the bytes saved")
    ap.add_argument("--recovery-only", action="store_true",
                    help="measure only the recovery: one tiers run of --iters steps saves the checkpoint (no "
                         "iteration comparison), then --repeat rounds of the two restores")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--persist-every", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--background-nice", type=int, default=10,
                    help="TierManager(background_nice=...) of the tiers run (0: the training's priority)")
    ap.add_argument("--throttle-mbps", type=int, default=200)
    ap.add_argument("--tier-size", default=4 << 30, type=int, help="bytes of the loop-mounted file system")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the three runs, interleaved; restores as many")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.state_mb is not None:
        a.layers = max(1, round(a.state_mb * 1e6 / _layer_state_bytes(a.width)))
    if a.iters < 3:
        ap.error("--iters must be at least 3 (the first two steps are warm-up, left out of the per-step costs)")
    if a.iters % a.persist_every:
        ap.error("--persist-every must divide --iters (the last step is then in every tier)")
    if a.dir.exists():
        shutil.rmtree(a.dir)
    a.dir.mkdir(parents=True)
    repo = str(Path(__file__).resolve().parents[1])
    base = {"repo": repo, "layers": a.layers, "width": a.width, "batch": a.batch, "iters": a.iters,
            "persist_every": a.persist_every, "replicas": a.replicas,
            "background_nice": a.background_nice}
    state_bytes = a.layers * _layer_state_bytes(a.width)
    report: dict = {"when": timestamp(), "args": {k: str(v) for k, v in vars(a).items()},
                    "state_bytes": state_bytes}
    with ThrottledTier(a.dir, a.tier_size, a.throttle_mbps) as tier:
        report["persistent_tier"] = {"throttle_mbps": a.throttle_mbps if not tier.why else None,
                                     "note": tier.why or None}
        if tier.why:
            print(f"note: {tier.why}", file=sys.stderr)
        report["persistent_tier"].update(measure_tier(tier.path))
        per_iter: dict[str, list] = {m: [] for m in MODES}
        tails: dict[str, list] = {m: [] for m in MODES}
        medians: dict[str, list] = {m: [] for m in MODES}  # each run's
        cpu: dict[str, list] = {m: [] for m in MODES}  # each run's CPU seconds per step and rank
        warm_cpu: dict[str, list] = {m: [] for m in MODES}  # ... of the warm steps only
        threads: dict[str, dict] = {m: {} for m in MODES}
        waits: dict[str, dict] = {m: {} for m in MODES}  # the training thread's, per warm step and rank
        errors: list = []
        modes = ("tiers",) if a.recovery_only else MODES
        train_rounds = 1 if a.recovery_only else a.repeat
        for rnd in range(train_rounds):  # interleaved: the machine's load drifts
            for mode in modes:
                persist = tier.path / f"{mode}{rnd}"
                persist.mkdir(exist_ok=True)
                cfg = {**base, "job": "train", "mode": mode, "local": str(a.dir / f"{mode}{rnd}" / "node{node}"),
                       "persist": str(persist)}
                res = run_job(cfg)
                its = [max(r["times"][i] for r in res) for i in range(2, a.iters)]  # the slowest rank, warm
                per_iter[mode] += its
                medians[mode].append(statistics.median(its))
                tails[mode].append(max(r["tail_seconds"] for r in res))
                cpu[mode].append(statistics.mean(r["cpu_seconds"] for r in res) / a.iters)
                warm_cpu[mode].append(statistics.mean(r["warm_cpu_seconds_per_step"] for r in res))
                for r in res:
                    for k, v in r["waits"].items():
                        waits[mode].setdefault(k, []).extend(v[2:])
                    for k, v in r["thread_cpu_seconds"].items():
                        threads[mode][k] = threads[mode].get(k, 0.0) + v / a.iters / WORLD / train_rounds
                errors += res[0]["errors"]
                print(f"round {rnd} {mode}: median iteration {medians[mode][-1] * 1e3:.1f} ms, "
                      f"{cpu[mode][-1]:.3f} CPU s per step and rank", flush=True)
        runs = {m: {"iter_median_s": statistics.median(per_iter[m]), "iter_mean_s": statistics.mean(per_iter[m]),
                    "run_medians_s": medians[m], "tail_s": max(tails[m]),
                    "cpu_per_step_s": statistics.median(cpu[m]), "run_cpu_per_step_s": cpu[m],
                    # what checkpointing adds, per step and rank, in CPU seconds of all the rank's threads
                    "checkpoint_cpu_per_step_s": (statistics.median(cpu[m]) - statistics.median(cpu["none"])
                                                  if cpu["none"] else None),
                    "warm_cpu_per_step_s": statistics.median(warm_cpu[m]),
                    "warm_checkpoint_cpu_per_step_s": (statistics.median(warm_cpu[m]) - statistics.median(warm_cpu["none"])
                                                       if warm_cpu["none"] else None),
                    "thread_cpu_per_step_s": threads[m],
                    "training_seconds_per_step": {k: statistics.mean(v) for k, v in waits[m].items()}}
                for m in modes}
        report["runs"] = runs
        report["errors"] = errors
        # node 1 lost: its local directory goes; the last round's checkpoints are restored
        last = train_rounds - 1
        shutil.rmtree(a.dir / f"tiers{last}" / "node1")
        cfg = {**base, "local": str(a.dir / f"tiers{last}" / "node{node}"), "persist": str(tier.path / f"tiers{last}")}
        step_path = tier.path / f"tiers{last}" / f"step_{a.iters:09d}"
        rts, rps = [], []
        dropped = True
        for _ in range(a.repeat):
            dropped &= drop_caches()[0]
            rts.append(run_job({**cfg, "job": "restore_tiers"}))
            dropped &= drop_caches()[0]
            rps.append(run_job({**cfg, "job": "restore_persistent", "path": str(step_path)}))
        # each restore's time: its slowest rank, from before the manager is
        # built (its groups are part of a restart) to the state loaded
        tiers_s = [max(r["seconds"] for r in rt) for rt in rts]
        pers_s = [max(r["seconds"] for r in rp) for rp in rps]
        rt = rts[-1]
        report["recovery"] = {
            "cold_cache": dropped, "tiers_runs_s": tiers_s, "persistent_runs_s": pers_s,
            "round_ratios": [p / t for p, t in zip(pers_s, tiers_s)],
            "tiers_s": statistics.median(tiers_s), "bytes_from": rt[0]["bytes_from"], "step": rt[0]["step"],
            "skipped": rt[0]["skipped"], "tiers_phases_rank0": rt[0]["phases"],
            # every rank's phases (the ranks of the node that receives replicas
            # also have "wait"), each the slowest rank's, and each round's
            "tiers_phases_max": {k: max(r["phases"].get(k, 0.0) for r in rt) for k in sorted({k for r in rt for k in r["phases"]})},
            "tiers_phases_by_round": [{k: round(max(r["phases"].get(k, 0.0) for r in x), 3)
                                       for k in sorted({k for r in x for k in r["phases"]})} for x in rts],
            "persistent_s": statistics.median(pers_s),
            "checkpoint_bytes": sum(f.stat().st_size for f in step_path.iterdir() if f.is_file()),
        }
    rec = report["recovery"]
    report["ratios"] = {"recovery_speedup_vs_persistent": rec["persistent_s"] / rec["tiers_s"]}
    if not a.recovery_only:
        none, tiers, stock = (runs[m]["iter_median_s"] for m in ("none", "tiers", "stock"))
        report["ratios"].update({
            "tiers_overhead_vs_none": tiers / none - 1,
            "stock_overhead_vs_none": stock / none - 1,
            "tiers_vs_stock_iteration": tiers / stock,
            # each round's runs against the same round's "none" (the machine's load drifts between rounds)
            "tiers_overhead_vs_none_by_round": [t / n - 1 for t, n in zip(runs["tiers"]["run_medians_s"],
                                                                          runs["none"]["run_medians_s"])],
            "stock_overhead_vs_none_by_round": [t / n - 1 for t, n in zip(runs["stock"]["run_medians_s"],
                                                                          runs["none"]["run_medians_s"])],
            "tiers_checkpoint_cpu_per_step_s": runs["tiers"]["checkpoint_cpu_per_step_s"],
            # the CPU a checkpoint takes, as a share of the training's: what a CPU-bound machine loses
            "tiers_warm_cpu_vs_none": runs["tiers"]["warm_cpu_per_step_s"] / runs["none"]["warm_cpu_per_step_s"] - 1,
            "stock_warm_cpu_vs_none": runs["stock"]["warm_cpu_per_step_s"] / runs["none"]["warm_cpu_per_step_s"] - 1,
            "stock_checkpoint_cpu_per_step_s": runs["stock"]["checkpoint_cpu_per_step_s"],
        })
        names = {"none": "none", "tiers": f"tiers (every step, {a.replicas} replica, drain /{a.persist_every})",
                 "stock": f"stock async_save /{a.persist_every}"}
        rows = [[names[m], f"{runs[m]['iter_median_s'] * 1e3:.1f}",
                 "-" if m == "none" else f"{(runs[m]['iter_median_s'] / none - 1) * 100:+.1f}%",
                 " ".join(f"{x * 1e3:.0f}" for x in runs[m]["run_medians_s"]),
                 f"{runs[m]['cpu_per_step_s']:.3f}", "-" if m == "none" else f"{runs[m]['checkpoint_cpu_per_step_s']:+.3f}",
                 f"{runs[m]['warm_cpu_per_step_s']:.3f}",
                 "-" if m == "none" else f"{runs[m]['warm_checkpoint_cpu_per_step_s'] / runs['none']['warm_cpu_per_step_s'] * 100:+.1f}%"]
                for m in MODES]
        print(format_table(["run", "median iteration ms", "vs none", "each run's median ms", "CPU s/step/rank",
                            "checkpoint CPU s/step/rank", "warm CPU s/step/rank", "warm CPU vs none"], rows))
        print("CPU s per step and rank, by thread: "
              + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(runs[m]["thread_cpu_per_step_s"].items(),
                                                                                key=lambda kv: -kv[1]))
                          for m in MODES))
        print("the training thread's mean seconds per step in: "
              + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[m]["training_seconds_per_step"].items())
                          for m in MODES if m != "none"))
    print(f"state {state_bytes / 1e6:.0f} MB ({a.layers} x Linear({a.width}, {a.width}) + AdamW), checkpoint "
          f"{rec['checkpoint_bytes'] / 1e6:.0f} MB on disk; persistent tier: {report['persistent_tier']}")
    print(f"recovery of step {rec['step']} after losing node 1 ({a.repeat} rounds, page cache dropped before each): "
          f"tiers {', '.join(f'{t:.2f}' for t in tiers_s)} s, persistent tier {', '.join(f'{t:.2f}' for t in pers_s)} s; "
          f"per round {', '.join(f'{r:.1f}x' for r in rec['round_ratios'])}; median "
          f"{report['ratios']['recovery_speedup_vs_persistent']:.1f}x faster from the tiers "
          f"(bytes {rec['bytes_from']}; slowest rank's phases by round: "
          + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in ph.items()) for ph in rec["tiers_phases_by_round"]) + ")"
          + ("" if rec["cold_cache"] else " (page cache NOT dropped: not root)"))
    if a.json:
        write_json(a.json, report)
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
