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
   previous upload), plus the upload time.  The fp_dcp children also measure
   a warm memcpy of the same kind (page-locked, pre-faulted buffers, the
   GIL released) in the same process, the yardstick of the staging copy.
   The last checkpoint of every contender is loaded back (a few tensors) and
   compared bit for bit.
2. **train** — a real model on the CPU (an MLP, forward, backward, AdamW)
   checkpointing its model and optimizer state every iteration and every
   ``--every`` iterations; throughput against the same loop without
   checkpoints, and peak RSS.  Lazy staging starts the save at the top of an
   iteration and waits for ``staging_completion`` just before
   ``optimizer.step()``; eager and stock save after the step.  Stock saves
   wait for the previous upload before the next (the writer does that itself
   for fp_dcp).

The table gives ratios and PASS/FAIL against the issue's targets; JSON with
the machine description goes to ``--json``.  The disk is shared: run it as
``flock /tmp/fp_dcp_bench.lock python benchmarks/bench_async.py ...``.

    python benchmarks/bench_async.py --quick          # smoke test (~2 min)
    python benchmarks/bench_async.py                  # 4 GiB, 5 steady saves, training loop
    python benchmarks/bench_async.py --parts train --train-iters 20 --every 5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]

# Targets of issue 4 ("Done when").
STAGING_VS_MEMCPY = 0.70  # steady-state eager staging bandwidth / warm memcpy
LAZY_RETURN_MAX_S = 0.050  # lazy async_save returns within, for 4 GiB
TRAIN_COST_MAX = 0.10  # throughput lost to per-iteration checkpointing
RSS_GROWTH_MAX = 64 * C.MiB  # across the steady-state saves

BLOCKING = ("fp_eager", "fp_lazy", "stock", "stock_stager")
TRAINING = ("none", "fp_eager", "fp_lazy", "stock", "stock_stager")


# ==========================================================================
# child side


def _fp():
    try:
        import fp_dcp  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fp_dcp":
            raise
        sys.path.insert(1, str(REPO))
    import fp_dcp

    return fp_dcp


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
            fp = _fp()
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


def _warm_memcpy(nbytes: int, reps: int = 3) -> dict:
    """A warm memcpy like the staging copy: between page-locked, pre-faulted
    buffers, the GIL released (fp_dcp._aio.copy_gather)."""
    import numpy as np

    from fp_dcp import _aio

    src = _aio.AlignedBuffer(nbytes)
    dst = _aio.AlignedBuffer(nbytes)
    best = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            _aio.copy_gather(dst, np.zeros(1, np.int64), [src])
            best.append(time.perf_counter() - t0)
    finally:
        dst.close()
        src.close()
    s = statistics.median(best[1:])
    return {"bytes": nbytes, "seconds": s, "gbps": nbytes / s / 1e9}


def _verify(path: Path, factory, keys: list[str]) -> list[str]:
    """Load a few tensors of the checkpoint and compare them with the spec."""
    import torch
    import torch.distributed.checkpoint as dcp

    spec = factory.spec
    sub = [t for t in spec.tensors if t.key in keys]
    out = {t.key: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in sub}
    fp = _fp()
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
    sd_spec = C.make_spec("large", spec["size_bytes"], spec["seed"])
    factory = C.StateDictFactory(sd_spec)
    sd = factory.build()
    payload = sd_spec.payload_bytes
    rss_base = C.rss_bytes()
    C.reset_peak_rss()
    saver = _Saver(kind, root)
    saves = []
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
            saves.append(rec)
        peak = C.peak_rss_bytes()
        last = root / f"ckpt{spec['saves'] % 2}"
        keys = [t.key for t in sd_spec.tensors[:: max(1, len(sd_spec.tensors) // 4)]]
        errors = _verify(last, factory, keys)
    finally:
        saver.close()
    out = {"ok": not errors, "errors": errors, "contender": kind, "payload_bytes": payload,
           "tensors": len(sd_spec.tensors), "saves": saves, "rss_base_bytes": rss_base,
           "peak_rss_bytes": peak, "torch_threads": torch.get_num_threads()}
    if kind == "fp_eager":
        out["memcpy"] = _warm_memcpy(min(payload, 1 << 30))
    return out


def _child_train(spec: dict) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    kind = spec["contender"]
    every = spec["every"]
    root = Path(spec["path"])
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    d, layers, batch = spec["width"], spec["layers"], spec["batch"]
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(d, d), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, d)
    y = torch.randn(batch, d)

    def step_fwd_bwd():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()

    def state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    # one step so that the optimizer state exists (the structure is final)
    step_fwd_bwd()
    opt.step()
    opt.zero_grad()
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state()))
    C.reset_peak_rss()
    saver = _Saver(kind, root) if kind != "none" else None
    warm, iters = spec["warmup"], spec["iters"]
    times = []
    save_walls = []
    k = 0
    try:
        for it in range(warm + iters):
            t0 = time.perf_counter()
            due = saver is not None and it % every == 0
            resp = None
            if due and saver.lazy:
                resp, _ = saver.save(state(), root / f"ckpt{k % 2}")
                k += 1
            step_fwd_bwd()
            if resp is not None:
                saver.staged(resp)
            opt.step()
            opt.zero_grad()
            if due and not saver.lazy:
                resp, _ = saver.save(state(), root / f"ckpt{k % 2}")
                k += 1
            times.append(time.perf_counter() - t0)
        t_end = time.perf_counter()
        if saver is not None:
            saver.finish()  # the last upload: not part of the loop's throughput
            # how long one save takes on its own, here (iteration >= save?)
            for _ in range(2):
                t0 = time.perf_counter()
                resp, _ = saver.save(state(), root / "alone")
                saver.staged(resp)
                saver.finish()
                save_walls.append(time.perf_counter() - t0)
    finally:
        if saver is not None:
            saver.close()
    timed = times[warm:]
    return {"ok": True, "contender": kind, "every": every, "iters": iters,
            "iter_s": timed, "seconds": sum(timed), "it_per_s": iters / sum(timed),
            "save_alone_s": min(save_walls) if save_walls else None,
            "state_bytes": state_bytes, "peak_rss_bytes": C.peak_rss_bytes(),
            "torch_threads": torch.get_num_threads(), "params": sum(p.numel() for p in model.parameters()),
            "_end": t_end}


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
            fp = _fp()
            result = {"ok": True, "version": fp.__version__, "file": fp.__file__}
        elif spec["part"] == "blocking":
            result = _child_blocking(spec)
        else:
            result = _child_train(spec)
    except BaseException as e:  # report, don't crash without a result line
        import traceback

        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc().splitlines()[-8:]}
    C.emit_result(result)


# ==========================================================================
# parent side


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


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
                                 "size_bytes": args.size_bytes, "seed": args.seed, "saves": args.saves},
                        timeout_s=args.child_timeout)
        shutil.rmtree(path, ignore_errors=True)
        if not r.get("ok"):
            print(f"    FAILED: {r.get('error') or r.get('errors')}", flush=True)
        out[kind] = r
    return out


def run_train(args, workdir: Path) -> dict:
    """Every loop once per round, alternating (A B C A B C ...); each loop's
    fastest round counts (other tenants of the machine only ever slow a
    round down), the others are kept in the JSON."""
    plan = [("none", 1)]
    for kind in args.training:
        if kind == "none":
            continue
        plan.append((kind, 1))
        if args.every > 1 and kind in ("fp_eager", "fp_lazy", "stock"):
            plan.append((kind, args.every))
    rounds: dict[str, list[dict]] = {}
    for rnd in range(args.train_rounds):
        # rotate the order: no loop always runs right after the same other one
        for kind, every in plan[rnd % len(plan):] + plan[:rnd % len(plan)]:
            _settle()
            path = workdir / f"train-{kind}-{every}"
            name = kind if kind == "none" else f"{kind}/{every}"
            r = C.run_child(SCRIPT, {"part": "train", "contender": kind, "every": every, "path": str(path),
                                     "width": args.width, "layers": args.layers, "batch": args.batch,
                                     "warmup": args.train_warmup, "iters": args.train_iters},
                            timeout_s=args.child_timeout)
            shutil.rmtree(path, ignore_errors=True)
            status = f"{r['it_per_s']:.3f} it/s" if r.get("ok") else f"FAILED: {r.get('error')}"
            print(f"  train round {rnd + 1}: {name:<15} {status}", flush=True)
            rounds.setdefault(name, []).append(r)
    out = {}
    for name, rs in rounds.items():
        ok = [r for r in rs if r.get("ok")]
        best = max(ok, key=lambda r: r["it_per_s"]) if ok else rs[0]
        out[name] = {**best, "rounds_it_per_s": [r.get("it_per_s") for r in rs]}
    return out


def report_blocking(res: dict) -> tuple[str, list[dict]]:
    rows, verdicts = [], []
    payload = next((r["payload_bytes"] for r in res.values() if r.get("ok")), None)
    for kind, r in res.items():
        if not r.get("ok"):
            rows.append([kind, "FAILED", "", "", "", "", "", "", ""])
            continue
        first, steady = r["saves"][0], r["saves"][1:]
        growth = (steady[-1]["rss"] - steady[0]["rss"]) if len(steady) > 1 else None
        rows.append([kind, _ms(first["return_s"]), _ms(first["staged_s"]), f"{first['upload_s']:.2f}",
                     _ms(_med([s["return_s"] for s in steady])), _ms(_med([s["staged_s"] for s in steady])),
                     f"{_med([s['upload_s'] for s in steady]):.2f}",
                     f"{r['peak_rss_bytes'] / C.GiB:.2f}",
                     "-" if growth is None else f"{growth / C.MiB:+.0f}"])
    text = [f"async_save blocking time, {C.fmt_size(payload or 0)} state dict "
            f"(first save | steady state, median of {max(0, len(next(iter(res.values())).get('saves', [])) - 1)})",
            C.format_table(["contender", "1st ret ms", "1st staged ms", "1st upload s", "ret ms",
                            "staged ms", "upload s", "peak RSS GiB", "RSS growth MiB"], rows)]
    eager, lazy = res.get("fp_eager", {}), res.get("fp_lazy", {})
    if eager.get("ok"):
        steady = eager["saves"][1:]
        st_gbps = _med([s["staging_gbps"] for s in steady])
        mc = eager["memcpy"]["gbps"]
        ratio = st_gbps / mc if st_gbps and mc else None
        verdicts.append({"what": "eager staging / warm memcpy (steady)", "value": f"{st_gbps:.1f} / {mc:.1f} GB/s",
                         "ratio": ratio, "target": f">= {STAGING_VS_MEMCPY:.2f}x",
                         "verdict": "n/a" if ratio is None else "PASS" if ratio >= STAGING_VS_MEMCPY else "FAIL"})
        zc = _med([s["zero_copy_bytes"] for s in steady])
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
        ret = _med([s["return_s"] for s in steady])
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
                fb = _med([s["staged_s"] for s in b["saves"][1:]])
                fr = _med([s["staged_s"] for s in r["saves"][1:]])
                verdicts.append({"what": f"{base} / {name}: time the training is held (steady)",
                                 "value": f"{_ms(fb)} / {_ms(fr)} ms", "ratio": fb / fr if fr else None,
                                 "target": "", "verdict": ""})
    return "\n".join(text), verdicts


def report_train(res: dict, every: int) -> tuple[str, list[dict]]:
    base = res.get("none", {})
    base_tp = base.get("it_per_s") if base.get("ok") else None
    rows, verdicts = [], []
    cost = {}
    for name, r in res.items():
        if not r.get("ok"):
            rows.append([name, "FAILED", "", "", "", "", ""])
            continue
        c = 1 - r["it_per_s"] / base_tp if base_tp else None
        cost[name] = c
        rows.append([name, f"{r['it_per_s']:.3f}", f"{statistics.median(r['iter_s']):.3f}",
                     " ".join(f"{x:.2f}" for x in r.get("rounds_it_per_s", []) if x),
                     "-" if c is None else f"{c * 100:+.1f}%",
                     "-" if r.get("save_alone_s") is None else f"{r['save_alone_s']:.2f}",
                     f"{r['peak_rss_bytes'] / C.GiB:.2f}"])
    b = base if base.get("ok") else next(iter(res.values()))
    text = [f"training loop: MLP {b.get('params', 0) / 1e6:.0f}M params, AdamW, "
            f"{C.fmt_size(b.get('state_bytes', 0))} state dict, {b.get('torch_threads')} torch threads; "
            f"checkpoint every iteration (/1) and every {every} (/{every}); "
            f"best of {len(b.get('rounds_it_per_s', [1]))} round(s) of {b.get('iters')} iterations",
            C.format_table(["loop", "it/s", "iter s (med)", "rounds it/s", "cost", "one save s", "peak RSS GiB"], rows)]
    it_s = statistics.median(base["iter_s"]) if base.get("ok") else None
    for name in ("fp_eager/1", "fp_lazy/1"):
        r = res.get(name, {})
        if not r.get("ok") or cost.get(name) is None:
            continue
        c = cost[name]
        verdicts.append({"what": f"{name}: throughput cost of per-iteration checkpoints", "value": f"{c * 100:.1f}%",
                         "ratio": None, "target": f"<= {TRAIN_COST_MAX * 100:.0f}%",
                         "verdict": "PASS" if c <= TRAIN_COST_MAX else "FAIL"})
        for stock in ("stock/1", "stock_stager/1"):
            if cost.get(stock) is not None:
                verdicts.append({"what": f"{name} cost < {stock} cost", "value": f"{c * 100:.1f}% vs {cost[stock] * 100:.1f}%",
                                 "ratio": None, "target": "less", "verdict": "PASS" if c < cost[stock] else "FAIL"})
        if it_s and r.get("save_alone_s"):
            verdicts.append({"what": f"{name}: iteration >= one save (precondition)", "value": f"{it_s:.2f} s vs {r['save_alone_s']:.2f} s",
                             "ratio": None, "target": "", "verdict": "yes" if it_s >= r["save_alone_s"] else "NO"})
    return "\n".join(text), verdicts


def format_verdicts(vs: list[dict]) -> str:
    rows = [[v["what"], v["value"], "-" if v["ratio"] is None else f"{v['ratio']:.2f}x", v["target"], v["verdict"]]
            for v in vs]
    return C.format_table(["check", "value", "ratio", "target", "verdict"], rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Blocking time of dcp.async_save and the cost of checkpointing a training loop: "
                    "fp_dcp eager/lazy staging vs stock async_save (FileSystemWriter, default stager "
                    "and DefaultStager). Each contender runs in a fresh subprocess.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default="blocking,train", help="comma list: blocking, train")
    p.add_argument("--size", default="4GiB", help="state dict of the blocking part")
    p.add_argument("--saves", type=int, default=5, help="steady-state saves after the first (blocking part)")
    p.add_argument("--blocking", default=",".join(BLOCKING), help="contenders of the blocking part")
    p.add_argument("--training", default=",".join(TRAINING), help="contenders of the training part")
    p.add_argument("--width", type=int, default=2048, help="MLP width")
    p.add_argument("--layers", type=int, default=12, help="MLP depth (Linear+GELU blocks)")
    p.add_argument("--batch", type=int, default=128, help="batch size (sets the iteration time)")
    p.add_argument("--train-iters", type=int, default=10, help="timed iterations per loop")
    p.add_argument("--train-warmup", type=int, default=2, help="untimed iterations first (arena, caches)")
    p.add_argument("--every", type=int, default=5, help="the sparse checkpoint interval")
    p.add_argument("--train-rounds", type=int, default=3,
                   help="rounds of the training part (loops alternate; each loop's fastest round counts)")
    p.add_argument("--quick", action="store_true", help="smoke test: 512MiB, 2 steady saves, 4 MLP layers, 6 iterations")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default ../bench_tmp)")
    p.add_argument("--json", type=Path, default=None, help="JSON output (default bench_out/async-<timestamp>.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-timeout", type=float, default=1800)
    p.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.saves, args.layers, args.train_iters, args.every, args.train_rounds = "512MiB", 2, 4, 6, 3, 1
    args.size_bytes = C.parse_size(args.size)
    args.parts = [x for x in args.parts.split(",") if x]
    args.blocking = [x for x in args.blocking.split(",") if x]
    args.training = [x for x in args.training.split(",") if x]
    for name, got, valid in (("parts", args.parts, ("blocking", "train")), ("blocking", args.blocking, BLOCKING),
                             ("training", args.training, TRAINING)):
        bad = sorted(set(got) - set(valid))
        if bad:
            p.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)}")
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ts = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = args.dir or (REPO.parent / "bench_tmp")
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    if "blocking" in args.parts:
        C.check_free_space(target, 3 * args.size_bytes)
    workdir = target / f"async-{ts}-{os.getpid()}"
    workdir.mkdir()
    probe = C.run_child(SCRIPT, {"part": "probe"}, timeout_s=300)
    if not probe.get("ok"):
        sys.exit(f"error: cannot import fp_dcp: {probe.get('error')}")
    hw = C.hardware_info(target)
    print(f"using fp_dcp {probe['version']} from {probe['file']}")
    for line in C.hardware_lines(hw):
        print(line)
    report = {"benchmark": "async", "timestamp": ts, "argv": sys.argv[1:], "hardware": hw,
              "size_bytes": args.size_bytes, "saves": args.saves}
    texts, verdicts = ["\n".join(C.hardware_lines(hw))], []
    try:
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
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if created:
            try:
                target.rmdir()
            except OSError:
                pass
    texts.append(format_verdicts(verdicts))
    report["verdicts"] = verdicts
    report["table"] = "\n\n".join(texts)
    print("\n" + report["table"])
    out = args.json or REPO / "bench_out" / f"async-{ts}.json"
    C.write_json(out, report)
    print(f"\nJSON: {out}")
    failed = any(not r.get("ok") for part in ("blocking", "train") for r in report.get(part, {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
