#!/usr/bin/env python
"""How long dcp.async_save holds the training: fp_dcp eager / lazy staging
beside stock dcp.async_save (FileSystemWriter with its default stager, and
with DefaultStager(StagingOptions(...))).

Two parts, each contender in a fresh subprocess (so the first save is really
a first save, and peak RSS is the contender's own):

1. **blocking** — a generated state dict (``--size``, default 4 GiB of large
   float32/bfloat16 tensors): the time until ``async_save`` returns and
   until ``staging_completion`` (the training may change the state), for the
   first save and the steady state (``--saves`` more, each waiting for the
   previous upload), plus the upload time.  The fp_dcp eager child also
   measures, right after each steady save, a warm memcpy of the same source
   tensors (the first GiB of them) into a pre-faulted page-locked buffer, the
   GIL released, split over the threads eager staging uses: the yardstick of
   the staging copy, paired save by save (the machine's other tenants come
   and go).  A memcpy between two huge-page buffers is printed beside it:
   the state dict's tensors sit in 4 KiB pages, which this VM's nested
   paging streams more slowly.
   First saves depend on whether the VM's host has backed the memory the
   arena gets (recently freed memory is much faster to fault in), so
   compare first saves with care; steady state is the point.
   The last checkpoint of every contender is loaded back (a few tensors) and
   compared bit for bit.
2. **train** — a real model on the CPU (an MLP, forward, backward, AdamW)
   checkpointing its model and optimizer state every iteration and every
   ``--every`` iterations; throughput against the same loop without
   checkpoints.  All loops run in one process, in blocks, each block between
   two no-checkpoint blocks (N A N B N C N ..., rotated each round, for
   ``--train-rounds`` rounds): other tenants of the machine come and go over
   seconds, so a loop's cost is the median over rounds of its throughput
   loss against the mean of its two neighbouring no-checkpoint blocks.  Peak RSS
   comes from each loop run alone in a fresh process.  Lazy staging starts
   the save at the top of an iteration and waits for ``staging_completion``
   just before ``optimizer.step()``; eager and stock save after the step.
   Stock saves wait for the previous upload before the next (the writer does
   that itself for fp_dcp).

The table gives ratios and PASS/FAIL against the issue's targets; JSON with
the machine description goes to ``--json``.  The disk is shared: run it as
``flock /tmp/fp_dcp_bench.lock python benchmarks/bench_async.py ...``.

    python benchmarks/bench_async.py --quick          # smoke test (~2 min)
    python benchmarks/bench_async.py                  # 4 GiB, 5 steady saves, training loop
    python benchmarks/bench_async.py --parts train --train-iters 20 --every 5
    python benchmarks/bench_async.py --parts blocking --mix small   # 9,245 small tensors: the per-tensor cost
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from fp_dcp.options import parse_size  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]

# Targets.
STAGING_VS_MEMCPY = 0.70  # steady-state eager staging bandwidth / warm memcpy
LAZY_RETURN_MAX_S = 0.050  # lazy async_save returns within, for 4 GiB
TRAIN_COST_MAX = 0.10  # throughput lost to per-iteration checkpointing
RSS_GROWTH_MAX = 64 * C.MiB  # across the steady-state saves

BLOCKING = ("fp_eager", "fp_lazy", "stock", "stock_stager")
TRAINING = ("none", "fp_eager", "fp_lazy", "stock", "stock_stager")


# ==========================================================================
# child side


def _stock_stager():
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    # Pinned memory and non-blocking copies need an accelerator; async staging
    # and the storage cache (reused from save to save) do not.
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=cuda))


class _Saver:
    """One contender's way of calling dcp.async_save."""

    def __init__(self, kind: str, root: Path):
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.kind = kind
        self.root = root
        self.writer = None
        self.stager = None
        self.prev = None  # stock: the previous upload, waited for before the next save
        if kind.startswith("fp_"):
            fp = C.import_fp_dcp()
            self.writer = fp.FastPersistWriter(staging=kind[3:])
        elif kind == "stock_stager":
            self.stager = _stock_stager()

    @property
    def lazy(self) -> bool:
        return self.kind in ("fp_lazy", "stock_stager")

    def save(self, sd: dict, path: Path):
        """Start a save; returns (response, seconds until async_save returned)."""
        if self.prev is not None and not self.kind.startswith("fp_"):
            self.prev.result()
        t0 = time.perf_counter()
        if self.writer is not None:
            resp = self.dcp.async_save(sd, storage_writer=self.writer, checkpoint_id=str(path))
        else:
            resp = self.dcp.async_save(sd, storage_writer=self.dcp.FileSystemWriter(str(path)),
                                       async_stager=self.stager)
        ret = time.perf_counter() - t0
        self.prev = getattr(resp, "upload_completion", resp)
        return resp, ret

    @staticmethod
    def staged(resp) -> None:
        s = getattr(resp, "staging_completion", None)
        if s is not None:
            s.result()

    def finish(self) -> None:
        if self.prev is not None:
            self.prev.result()
            self.prev = None

    def close(self) -> None:
        self.finish()
        if self.writer is not None:
            self.writer.close()
        if self.stager is not None:
            self.stager.close()


def _warm_memcpy(nbytes: int, threads: int = 1, reps: int = 3) -> dict:
    """A warm memcpy like the staging copy: between page-locked, pre-faulted
    buffers, the GIL released (fp_dcp._aio.copy_gather), split over
    ``threads`` threads as eager staging splits its copy."""
    import concurrent.futures

    import numpy as np

    from fp_dcp import _native

    src = _native.AlignedBuffer(nbytes)
    dst = _native.AlignedBuffer(nbytes)
    part = -(-nbytes // threads)
    s_view, d_view = memoryview(src), memoryview(dst)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    runs = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            futs = [pool.submit(_native.copy_gather, d_view[lo:lo + part], np.zeros(1, np.int64), [s_view[lo:lo + part]])
                    for lo in range(0, nbytes, part)]
            for f in futs:
                f.result()
            runs.append(time.perf_counter() - t0)
    finally:
        pool.shutdown()
        s_view.release()
        d_view.release()
        dst.close()
        src.close()
    s = statistics.median(runs[1:])
    return {"bytes": nbytes, "threads": threads, "seconds": s, "gbps": nbytes / s / 1e9}


def _memcpy_sources(tensors, dst, threads: int) -> dict:
    """The staging copy's yardstick, paired with each steady save: a warm
    memcpy of the same source tensors (up to ``len(dst)`` bytes of them) into
    a pre-faulted page-locked buffer, the GIL released, split over
    ``threads`` threads in 64 MiB pieces as eager staging splits its copy.
    The sources matter: the state dict's tensors sit in the allocator's 4 KiB
    pages, and this VM's nested paging makes streaming them slower than
    streaming huge pages (the buffer-to-buffer figure is printed beside it)."""
    import concurrent.futures

    import numpy as np
    import torch

    from fp_dcp import _native

    pieces, offs, pos = [], [], 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            continue
        b = t.reshape(-1).view(torch.uint8).numpy()
        for lo in range(0, len(b), 64 << 20):
            piece = b[lo : lo + (64 << 20)][: len(dst) - pos]
            if not len(piece):
                break
            pieces.append(piece)
            offs.append(pos)
            pos += len(piece)
        if pos >= len(dst):
            break
    groups = [([], []) for _ in range(threads)]
    loads = [0] * threads
    for o, piece in zip(offs, pieces):
        g = loads.index(min(loads))
        groups[g][0].append(o)
        groups[g][1].append(piece)
        loads[g] += len(piece)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        futs = [pool.submit(_native.copy_gather, dst, np.asarray(o, np.int64), b) for o, b in groups if b]
        for f in futs:
            f.result()
        seconds = time.perf_counter() - t0
    return {"bytes": pos, "threads": threads, "seconds": seconds, "gbps": pos / seconds / 1e9}


def _verify(path: Path, factory, keys: list[str]) -> list[str]:
    """Load a few tensors of the checkpoint and compare them with the spec."""
    import torch
    import torch.distributed.checkpoint as dcp

    spec = factory.spec
    sub = [t for t in spec.tensors if t.key in keys]
    out = {t.key: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in sub}
    fp = C.import_fp_dcp()
    reader = fp.FastPersistReader(str(path)) if _is_fp(path) else None
    dcp.load(out, checkpoint_id=str(path), storage_reader=reader)
    sub_spec = C.StateDictSpec(spec.mix, spec.seed, sub, {})
    return C.StateDictFactory(sub_spec).verify(out)


def _is_fp(path: Path) -> bool:
    return any(n.endswith(".fpd") for n in os.listdir(path))


def _child_blocking(spec: dict) -> dict:
    import torch

    kind = spec["contender"]
    root = Path(spec["path"])
    root.mkdir(parents=True, exist_ok=True)
    sd_spec = C.make_spec(spec.get("mix", "large"), spec["size_bytes"], spec["seed"])
    factory = C.StateDictFactory(sd_spec)
    sd = factory.build()
    payload = sd_spec.payload_bytes
    rss_base = C.rss_bytes()
    C.reset_peak_rss()
    saver = _Saver(kind, root)
    saves = []
    k = max(1, min(torch.get_num_threads(), 4))  # eager staging's copy threads
    yard = None
    if kind == "fp_eager":
        from fp_dcp import _native

        yard = _native.AlignedBuffer(min(payload, 1 << 30))
        _memcpy_sources(list(sd.values()), yard, k)  # warm
    try:
        for i in range(1 + spec["saves"]):
            path = root / f"ckpt{i % 2}"
            if i >= 2:
                shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            resp, ret = saver.save(sd, path)
            saver.staged(resp)
            staged = time.perf_counter() - t0
            saver.finish()
            done = time.perf_counter() - t0
            rec = {"return_s": ret, "staged_s": staged, "upload_s": done, "rss": C.rss_bytes()}
            if saver.writer is not None:
                st = saver.writer.staging_stats
                rec.update(staging_s=st.get("seconds"), staging_gbps=st.get("gbps"),
                           arena_bytes=st.get("arena_bytes"), arena_allocated=st.get("arena_allocated"),
                           zero_copy_bytes=saver.writer.last_stats.get("zero_copy_bytes"),
                           write_gbps=saver.writer.last_stats.get("gbps"))
            if yard is not None and i >= 1:
                rec["memcpy_sources_gbps"] = _memcpy_sources(list(sd.values()), yard, k)["gbps"]
            saves.append(rec)
        peak = C.peak_rss_bytes()
        last = root / f"ckpt{spec['saves'] % 2}"
        keys = [t.key for t in sd_spec.tensors[:: max(1, len(sd_spec.tensors) // 4)]]
        errors = _verify(last, factory, keys)
    finally:
        saver.close()
        if yard is not None:
            yard.close()
    out = {"ok": not errors, "errors": errors, "contender": kind, "payload_bytes": payload,
           "tensors": len(sd_spec.tensors), "saves": saves, "rss_base_bytes": rss_base,
           "peak_rss_bytes": peak, "torch_threads": torch.get_num_threads()}
    if kind == "fp_eager":
        # beside it, a memcpy between two huge-page buffers: the better of one
        # thread and as many as eager staging uses
        n = min(payload, 1 << 30)
        out["memcpy"] = max((_warm_memcpy(n, t) for t in sorted({1, k})), key=lambda m: m["gbps"])
    return out


class _Trainer:
    """An MLP trained with AdamW on the CPU; its state dict is what a
    checkpoint saves (model and optimizer, DCP's get_state_dict)."""

    def __init__(self, spec: dict):
        import torch

        torch.manual_seed(0)
        d, layers, batch = spec["width"], spec["layers"], spec["batch"]
        self.torch = torch
        self.model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(d, d), torch.nn.GELU())])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, d)
        self.y = torch.randn(batch, d)
        self.forward_backward()  # one step so that the optimizer state exists
        self.step()
        self.state_bytes = sum(t.numel() * t.element_size() for t in _tensors(self.state()))
        self.params = sum(p.numel() for p in self.model.parameters())

    def forward_backward(self) -> None:
        loss = self.torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def run(self, saver: "_Saver | None", every: int, iters: int, root: Path, first: int = 0) -> list[float]:
        """``iters`` iterations checkpointing every ``every`` (lazy: the save
        starts at the top and staging is awaited before the step; eager and
        stock: the save starts after the step); per-iteration seconds."""
        times = []
        for it in range(first, first + iters):
            t0 = time.perf_counter()
            due = saver is not None and it % every == 0
            resp = None
            if due and saver.lazy:
                resp, _ = saver.save(self.state(), root / f"ckpt{(it // every) % 2}")
            self.forward_backward()
            if resp is not None:
                saver.staged(resp)
            self.step()
            if due and not saver.lazy:
                saver.save(self.state(), root / f"ckpt{(it // every) % 2}")
            times.append(time.perf_counter() - t0)
        return times

    def save_alone(self, saver: "_Saver", root: Path) -> float:
        """One save on its own, until uploaded (is an iteration no shorter?)."""
        walls = []
        for _ in range(2):
            t0 = time.perf_counter()
            resp, _ = saver.save(self.state(), root / "alone")
            saver.staged(resp)
            saver.finish()
            walls.append(time.perf_counter() - t0)
        return min(walls)


def _child_train(spec: dict) -> dict:
    """Every loop in one process, each block between two no-checkpoint
    blocks (N A N B N C N ..., rotated each round): other tenants of the
    machine come and go over seconds, so a loop is compared with the
    no-checkpoint blocks run just before and just after it."""
    import torch

    root = Path(spec["path"])
    loops = [tuple(x) for x in spec["loops"] if x[0] != "none"]
    trainer = _Trainer(spec)
    savers: dict[str, _Saver] = {}
    samples: dict[str, list[dict]] = {}
    alone: dict[str, float] = {}

    def block(kind: str, every: int) -> tuple[float, float]:
        """(it/s, process CPU seconds per iteration) of one block."""
        saver = None
        if kind != "none":
            saver = savers.get(kind) or savers.setdefault(kind, _Saver(kind, root / kind))
        iters = -(-spec["iters"] // every) * every
        # one untimed period first: a save is in flight when the timed ones start
        trainer.run(saver, every, every, root / kind)
        c0 = os.times()
        times = trainer.run(saver, every, iters, root / kind, first=every)
        if saver is not None:
            saver.finish()  # the block's last upload: outside the clock, its CPU counted
        c1 = os.times()
        return iters / sum(times), (c1.user + c1.system - c0.user - c0.system) / iters

    try:
        for rnd in range(spec["rounds"]):
            before, cpu_before = block("none", 1)
            for kind, every in loops[rnd % len(loops):] + loops[: rnd % len(loops)]:
                tp, cpu = block(kind, every)
                after, cpu_after = block("none", 1)
                samples.setdefault(f"{kind}/{every}", []).append(
                    {"it_per_s": tp, "none_before": before, "none_after": after, "cpu_s": cpu,
                     "none_cpu_s": (cpu_before + cpu_after) / 2})
                samples.setdefault("none", []).append(
                    {"it_per_s": after, "none_before": before, "none_after": after, "cpu_s": cpu_after,
                     "none_cpu_s": (cpu_before + cpu_after) / 2})
                before, cpu_before = after, cpu_after
        for kind, saver in savers.items():
            alone[kind] = trainer.save_alone(saver, root / kind)
    finally:
        for saver in savers.values():
            saver.close()
    return {"ok": True, "samples": samples, "save_alone_s": alone, "state_bytes": trainer.state_bytes,
            "params": trainer.params, "torch_threads": torch.get_num_threads(), "iters": spec["iters"],
            "rounds": spec["rounds"]}


def _child_train_rss(spec: dict) -> dict:
    """One loop alone in a fresh process: its peak RSS."""
    kind = spec["contender"]
    root = Path(spec["path"])
    trainer = _Trainer(spec)
    C.reset_peak_rss()
    base = C.rss_bytes()
    saver = _Saver(kind, root) if kind != "none" else None
    try:
        times = trainer.run(saver, 1, spec["iters"], root)
        if saver is not None:
            saver.finish()
    finally:
        if saver is not None:
            saver.close()
    return {"ok": True, "contender": kind, "peak_rss_bytes": C.peak_rss_bytes(), "rss_base_bytes": base,
            "it_per_s": len(times) / sum(times)}


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def child_main(spec_json: str) -> None:
    import json

    warnings.filterwarnings("ignore")
    spec = json.loads(spec_json)
    try:
        if spec["part"] == "probe":
            fp = C.import_fp_dcp()
            result = {"ok": True, "version": fp.__version__, "file": fp.__file__}
        elif spec["part"] == "blocking":
            result = _child_blocking(spec)
        elif spec["part"] == "train":
            result = _child_train(spec)
        else:
            result = _child_train_rss(spec)
    except BaseException as e:  # report, don't crash without a result line
        import traceback

        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc().splitlines()[-8:]}
    C.emit_result(result)


# ==========================================================================
# parent side


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _settle() -> None:
    """Before each child: write back what the previous one left dirty (stock
    writes through the page cache) and drop the cache, so that no contender
    pays for the previous one's writeback."""
    C.drop_caches()


def run_blocking(args, workdir: Path) -> dict:
    out = {}
    for kind in args.blocking:
        _settle()
        path = workdir / f"blocking-{kind}"
        print(f"  blocking: {kind} ...", flush=True)
        r = C.run_child(SCRIPT, {"part": "blocking", "contender": kind, "path": str(path),
                                 "size_bytes": args.size_bytes, "mix": args.mix, "seed": args.seed,
                                 "saves": args.saves},
                        timeout_s=args.child_timeout)
        shutil.rmtree(path, ignore_errors=True)
        if not r.get("ok"):
            print(f"    FAILED: {r.get('error') or r.get('errors')}", flush=True)
        out[kind] = r
    return out


def run_train(args, workdir: Path) -> dict:
    loops = [("none", 1)]
    for kind in args.training:
        if kind == "none":
            continue
        loops.append((kind, 1))
        if args.every > 1 and kind in ("fp_eager", "fp_lazy", "stock"):
            loops.append((kind, args.every))
    model = {"width": args.width, "layers": args.layers, "batch": args.batch}
    _settle()
    print(f"  train: {len(loops)} loops x {args.train_rounds} rounds, interleaved in one process ...", flush=True)
    path = workdir / "train"
    r = C.run_child(SCRIPT, {"part": "train", "path": str(path), "loops": loops, "rounds": args.train_rounds,
                             "iters": args.train_iters, **model}, timeout_s=args.child_timeout)
    shutil.rmtree(path, ignore_errors=True)
    if not r.get("ok"):
        print(f"    FAILED: {r.get('error')}", flush=True)
    rss = {}
    for kind in ["none"] + [k for k in args.training if k != "none"]:
        _settle()
        path = workdir / f"rss-{kind}"
        print(f"  train (peak RSS): {kind} alone ...", flush=True)
        rss[kind] = C.run_child(SCRIPT, {"part": "train_rss", "contender": kind, "path": str(path),
                                         "iters": args.train_rss_iters, **model}, timeout_s=args.child_timeout)
        shutil.rmtree(path, ignore_errors=True)
    return {"interleaved": r, "rss": rss}


def report_blocking(res: dict) -> tuple[str, list[dict]]:
    rows, verdicts = [], []
    payload = next((r["payload_bytes"] for r in res.values() if r.get("ok")), None)
    tensors = next((r["tensors"] for r in res.values() if r.get("ok") and "tensors" in r), None)
    for kind, r in res.items():
        if not r.get("ok"):
            rows.append([kind, "FAILED", "", "", "", "", "", "", ""])
            continue
        first, steady = r["saves"][0], r["saves"][1:]
        growth = (steady[-1]["rss"] - steady[0]["rss"]) if len(steady) > 1 else None
        rows.append([kind, _ms(first["return_s"]), _ms(first["staged_s"]), f"{first['upload_s']:.2f}",
                     _ms(C.median([s["return_s"] for s in steady])), _ms(C.median([s["staged_s"] for s in steady])),
                     f"{C.median([s['upload_s'] for s in steady]):.2f}",
                     f"{r['peak_rss_bytes'] / C.GiB:.2f}",
                     "-" if growth is None else f"{growth / C.MiB:+.0f}"])
    text = [f"async_save blocking time, {C.fmt_size(payload or 0)} state dict"
            f"{'' if tensors is None else f' of {tensors:,} tensors'} "
            f"(first save | steady state, median of {max(0, len(next(iter(res.values())).get('saves', [])) - 1)})",
            C.format_table(["contender", "1st ret ms", "1st staged ms", "1st upload s", "ret ms",
                            "staged ms", "upload s", "peak RSS GiB", "RSS growth MiB"], rows)]
    eager, lazy = res.get("fp_eager", {}), res.get("fp_lazy", {})
    if eager.get("ok"):
        steady = eager["saves"][1:]
        st_gbps = C.median([s["staging_gbps"] for s in steady])
        same = C.median([s["memcpy_sources_gbps"] for s in steady if s.get("memcpy_sources_gbps")])
        ratio = C.median([s["staging_gbps"] / s["memcpy_sources_gbps"] for s in steady if s.get("memcpy_sources_gbps")])
        verdicts.append({"what": "eager staging / warm memcpy of the same tensors (paired per save, steady)",
                         "value": f"{st_gbps:.1f} / {same:.1f} GB/s" if same else "-",
                         "ratio": ratio, "target": f">= {STAGING_VS_MEMCPY:.2f}x",
                         "verdict": "n/a" if ratio is None else "PASS" if ratio >= STAGING_VS_MEMCPY else "FAIL"})
        mc = eager["memcpy"]["gbps"]
        verdicts.append({"what": f"eager staging / memcpy huge-page buffer to buffer ({eager['memcpy']['threads']} thr.)",
                         "value": f"{st_gbps:.1f} / {mc:.1f} GB/s", "ratio": st_gbps / mc if st_gbps and mc else None,
                         "target": "", "verdict": ""})
        zc = C.median([s["zero_copy_bytes"] for s in steady])
        verdicts.append({"what": "eager: bytes written zero-copy from the arena", "value": C.fmt_size(zc or 0),
                         "ratio": (zc / eager["payload_bytes"]) if zc else None, "target": "", "verdict": ""})
        arena = steady[-1]["arena_bytes"] if steady else None
        if arena:
            verdicts.append({"what": "arena size / state dict", "value": C.fmt_size(arena), "ratio": arena / eager["payload_bytes"],
                             "target": "state dict + padding", "verdict": ""})
    for name, r in (("fp_eager", eager), ("fp_lazy", lazy)):
        if r.get("ok") and len(r["saves"]) > 2:
            steady = r["saves"][1:]
            growth = steady[-1]["rss"] - steady[0]["rss"]
            verdicts.append({"what": f"{name}: RSS growth over {len(steady)} steady saves", "value": f"{growth / C.MiB:+.0f} MiB",
                             "ratio": None, "target": f"<= {RSS_GROWTH_MAX // C.MiB} MiB",
                             "verdict": "PASS" if growth <= RSS_GROWTH_MAX else "FAIL"})
    if lazy.get("ok"):
        steady = lazy["saves"][1:]
        ret = C.median([s["return_s"] for s in steady])
        verdicts.append({"what": "lazy async_save return (steady)", "value": f"{_ms(ret)} ms", "ratio": None,
                         "target": f"<= {LAZY_RETURN_MAX_S * 1e3:.0f} ms",
                         "verdict": "PASS" if ret <= LAZY_RETURN_MAX_S else "FAIL"})
        verdicts.append({"what": "lazy async_save return (first save)", "value": f"{_ms(lazy['saves'][0]['return_s'])} ms",
                         "ratio": None, "target": f"<= {LAZY_RETURN_MAX_S * 1e3:.0f} ms",
                         "verdict": "PASS" if lazy["saves"][0]["return_s"] <= LAZY_RETURN_MAX_S else "FAIL"})
    for base in ("stock", "stock_stager"):
        b = res.get(base, {})
        for name, r in (("fp_eager", eager), ("fp_lazy", lazy)):
            if b.get("ok") and r.get("ok"):
                fb = C.median([s["staged_s"] for s in b["saves"][1:]])
                fr = C.median([s["staged_s"] for s in r["saves"][1:]])
                verdicts.append({"what": f"{base} / {name}: time the training is held (steady)",
                                 "value": f"{_ms(fb)} / {_ms(fr)} ms", "ratio": fb / fr if fr else None,
                                 "target": "", "verdict": ""})
    return "\n".join(text), verdicts


def report_train(res: dict, every: int) -> tuple[str, list[dict]]:
    r = res["interleaved"]
    rss = res["rss"]
    if not r.get("ok"):
        return f"training loop FAILED: {r.get('error')}", []
    samples = r["samples"]
    rows, verdicts, cost = [], [], {}
    for name, ss in samples.items():
        # against the mean of the no-checkpoint blocks just before and after
        c = statistics.median(1 - x["it_per_s"] / ((x["none_before"] + x["none_after"]) / 2) for x in ss)
        cost[name] = c
        kind = name.split("/")[0]
        peak = rss.get(kind, {}).get("peak_rss_bytes") if name in ("none", f"{kind}/1") else None
        a = r["save_alone_s"].get(kind)
        tps = [x["it_per_s"] for x in ss]
        extra_cpu = statistics.median(x["cpu_s"] - x["none_cpu_s"] for x in ss)
        rows.append([name, f"{statistics.median(tps):.3f}", f"{min(tps):.2f}-{max(tps):.2f}",
                     "-" if name == "none" else f"{c * 100:+.1f}%",
                     f"{statistics.median(x['cpu_s'] for x in ss) * 1e3:.0f}",
                     "-" if name == "none" else f"{extra_cpu * 1e3:+.0f}",
                     "-" if a is None else f"{a:.2f}", "-" if peak is None else f"{peak / C.GiB:.2f}"])
    none = [x["it_per_s"] for x in samples["none"]]
    text = [f"training loop: MLP {r['params'] / 1e6:.0f}M params, AdamW, {C.fmt_size(r['state_bytes'])} state dict, "
            f"{r['torch_threads']} torch threads; checkpoint every iteration (/1) and every {every} (/{every}); "
            f"{r['rounds']} rounds of {r['iters']}-iteration blocks in one process, each between two no-checkpoint "
            f"blocks; cost = median of 1 - it/s / mean it/s of those two; extra CPU = process CPU per iteration beyond "
            f"theirs (robust to other tenants); peak RSS: the loop alone in a fresh process",
            C.format_table(["loop", "it/s (med)", "it/s range", "cost", "CPU ms/it", "extra CPU ms/it",
                            "one save s", "peak RSS GiB"], rows)]
    it_s = 1 / statistics.median(none)
    for name in ("fp_eager/1", "fp_lazy/1"):
        if name not in cost:
            continue
        c = cost[name]
        verdicts.append({"what": f"{name}: throughput cost of per-iteration checkpoints", "value": f"{c * 100:.1f}%",
                         "ratio": None, "target": f"<= {TRAIN_COST_MAX * 100:.0f}%",
                         "verdict": "PASS" if c <= TRAIN_COST_MAX else "FAIL"})
        for stock in ("stock/1", "stock_stager/1"):
            if stock in cost:
                verdicts.append({"what": f"{name} cost < {stock} cost", "value": f"{c * 100:.1f}% vs {cost[stock] * 100:.1f}%",
                                 "ratio": None, "target": "less", "verdict": "PASS" if c < cost[stock] else "FAIL"})
        a = r["save_alone_s"].get(name.split("/")[0])
        if a:
            verdicts.append({"what": f"{name}: iteration >= one save (precondition)", "value": f"{it_s:.2f} s vs {a:.2f} s",
                             "ratio": None, "target": "", "verdict": "yes" if it_s >= a else "NO"})
    return "\n".join(text), verdicts


def format_verdicts(vs: list[dict]) -> str:
    rows = [[v["what"], v["value"], "-" if v["ratio"] is None else f"{v['ratio']:.2f}x", v["target"], v["verdict"]]
            for v in vs]
    return C.format_table(["check", "value", "ratio", "target", "verdict"], rows)


def parse_args(argv=None):
    p = C.parser(
        "Blocking time of dcp.async_save and the cost of checkpointing a training loop: "
        "fp_dcp eager/lazy staging vs stock async_save (FileSystemWriter, default stager "
        "and DefaultStager). Each contender runs in a fresh subprocess.", "async",
        size="4GiB", size_help="state dict of the blocking part",
        quick="smoke test: 512MiB, 2 steady saves, 4 MLP layers, 6 iterations",
        seed="seed of the generated state dict", child_timeout=1800,
        dir_help="where checkpoints go (default ../bench_tmp)")
    p.add_argument("--parts", default="blocking,train", help="comma list: blocking, train")
    p.add_argument("--saves", type=int, default=5, help="steady-state saves after the first (blocking part)")
    p.add_argument("--mix", default="large", choices=("large", "small"),
                   help="state dict of the blocking part: large tensors, or thousands of small ones and a few "
                        "objects (9,245 tensors at 4GiB: what the call costs per tensor)")
    p.add_argument("--blocking", default=",".join(BLOCKING), help="contenders of the blocking part")
    p.add_argument("--training", default=",".join(TRAINING), help="contenders of the training part")
    p.add_argument("--width", type=int, default=2048, help="MLP width")
    p.add_argument("--layers", type=int, default=12, help="MLP depth (Linear+GELU blocks)")
    p.add_argument("--batch", type=int, default=128, help="batch size (sets the iteration time)")
    p.add_argument("--train-iters", type=int, default=6, help="timed iterations per block (rounded up to --every)")
    p.add_argument("--every", type=int, default=5, help="the sparse checkpoint interval")
    p.add_argument("--train-rounds", type=int, default=5,
                   help="rounds of the training part (a block of each loop, each between no-checkpoint blocks)")
    p.add_argument("--train-rss-iters", type=int, default=4,
                   help="iterations of each loop run alone in a fresh process for its peak RSS")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.saves, args.layers, args.train_iters, args.every, args.train_rounds = "512MiB", 2, 4, 6, 3, 2
    args.size_bytes = parse_size(args.size)
    args.parts = [x for x in args.parts.split(",") if x]
    args.blocking = [x for x in args.blocking.split(",") if x]
    args.training = [x for x in args.training.split(",") if x]
    for name, got, valid in (("parts", args.parts, ("blocking", "train")), ("blocking", args.blocking, BLOCKING),
                             ("training", args.training, TRAINING)):
        bad = sorted(set(got) - set(valid))
        if bad:
            p.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)}")
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    with C.Bench("async", args) as bench:
        workdir = bench.make_workdir(3 * args.size_bytes if "blocking" in args.parts else None)
        probe = C.run_child(SCRIPT, {"part": "probe"}, timeout_s=300)
        if not probe.get("ok"):
            sys.exit(f"error: cannot import fp_dcp: {probe.get('error')}")
        print(f"using fp_dcp {probe['version']} from {probe['file']}")
        hw = bench.hardware()
        report = bench.report(hardware=hw, size_bytes=args.size_bytes, mix=args.mix, saves=args.saves)
        texts, verdicts = ["\n".join(C.hardware_lines(hw))], []
        if "blocking" in args.parts:
            res = run_blocking(args, workdir)
            report["blocking"] = res
            t, v = report_blocking(res)
            texts.append(t)
            verdicts += v
        if "train" in args.parts:
            res = run_train(args, workdir)
            report["train"] = res
            t, v = report_train(res, args.every)
            texts.append(t)
            verdicts += v
        texts.append(format_verdicts(verdicts))
        report["verdicts"] = verdicts
        report["table"] = "\n\n".join(texts)
        print("\n" + report["table"])
        bench.write(report)
    failed = any(not r.get("ok") for r in report.get("blocking", {}).values())
    if "train" in report:
        t = report["train"]
        failed = failed or not t["interleaved"].get("ok") or any(not r.get("ok") for r in t["rss"].values())
    return 1 if failed else 0


def main(argv=None) -> int:
    return C.main(child_main, run, argv)


if __name__ == "__main__":
    sys.exit(main())
