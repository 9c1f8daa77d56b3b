"""A picture of the speed: save and load throughput of every contender of
bench_save_load.py runs, per device profile, against the device's best.

    python benchmarks/plot.py                          # the newest bench_out/save_load-*.json
    python benchmarks/plot.py bench_out/a.json bench_out/b.json --out docs/speed

A device profile is one state-dict mix (large tensors / small tensors) on one
machine's target device (one JSON file each: the hardware it records names
it).  For each, the figure shows the median GB/s of every checkpointing
contender (fp_dcp, stock, stock-t4, torch.save, ...) for save and for cold
load, and the device's best: the fastest raw contender of the same run
(raw write for saves, raw read for loads), as a dashed line.  The same
figures go to a Markdown table, with each contender's ratio to the device's
best and the command that regenerates the JSON.

Writes OUT.png and OUT.md (default: next to the first JSON, same name).  The
table needs nothing but the standard library; the PNG needs matplotlib, a
benchmark extra: pip install -e ".[bench]".  Exit code 0 when both were
written, 1 when the PNG could not be (the table is written anyway), 2 for a
usage error (no JSON).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import _common as C  # noqa: E402
MIX_NAMES = {"large": "large tensors", "small": "small tensors + objects"}


def _profile_name(report: dict[str, Any], name: str) -> str:
    """``bare`` or ``throttled to 1000 IOPS``: the device profile a mix ran in."""
    for p in report.get("profiles") or []:
        if p.get("profile") == name and p.get("read_iops"):
            return f"{name} ({p['read_iops']} read / {p.get('write_iops')} write IOPS)"
    return name


def load_profiles(paths: list[str]) -> list[dict[str, Any]]:
    """One profile per (JSON file, mix): the device, the contenders' median
    GB/s (save, load), and the device's best raw write / read."""
    profiles = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        if report.get("benchmark") != "save_load":
            raise ValueError(f"{path}: not a bench_save_load.py result (benchmark={report.get('benchmark')!r})")
        device = device_label(report.get("hardware", {}))
        roles = {c["name"]: c.get("role", c.get("kind")) for c in report.get("contenders", [])}
        for mix in report.get("mixes", []):
            contenders, raw = [], {"save": (None, None), "load": (None, None)}
            for name, summ in mix["summary"].items():
                role = summ.get("save", {}).get("role") or roles.get(name)
                if role == "raw":
                    for op in ("save", "load"):
                        v = summ[op].get("median")
                        if v and (raw[op][0] is None or v > raw[op][0]):
                            raw[op] = (v, name)
                    continue
                if role == "dcp_floor":  # DCP's own time with no storage: a bound, not a contender
                    continue
                contenders.append({
                    "name": name,
                    "save": summ["save"].get("median"), "load": summ["load"].get("median"),
                    "save_n": summ["save"].get("n", 0), "load_n": summ["load"].get("n", 0),
                    "cold": summ["load"].get("cold"),
                })
            profiles.append({
                "source": path, "device": device, "mix": mix["mix"],
                "title": f"{MIX_NAMES.get(mix['mix'], mix['mix'])}, {_size(mix.get('payload_bytes'))}"
                         + (f", {_profile_name(report, mix['profile'])}" if mix.get("profile") else ""),
                "tensors": mix.get("tensors"), "objects": mix.get("objects"),
                "contenders": contenders, "raw": raw,
                "command": "python benchmarks/bench_save_load.py " + " ".join(report.get("argv", [])),
                "timestamp": report.get("timestamp"), "cold_loads": report.get("cold_loads"),
            })
    return profiles


def device_label(hw: dict) -> str:
    bd = hw.get("block_device") or {}
    disk = bd.get("disk") or bd.get("name") or hw.get("mount_source") or "?"
    rot = {"0": "SSD", "1": "rotational/virtual"}.get(str(bd.get("rotational")), "")
    return (f"{hw.get('fs_type', '?')} on {disk}" + (f" ({rot})" if rot else "")
            + f", {hw.get('cpu_cores', '?')} cores")


def _size(n: int | None) -> str:
    return C.fmt_size(n, trim=True) if n else "?"


def _gbps(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def _ratio(v: float | None, best: float | None) -> str:
    return f"{v / best:.2f}x" if v and best else "-"


def figure_rows(profile: dict[str, Any], raw_label: str, lead: tuple[str, ...] = ()) -> list[str]:
    """A profile's Markdown rows: each contender's save GB/s, save / best raw
    write, load GB/s (``(warm)`` where no cold load was measured) and load /
    best raw read, then the raw reference's row, labelled ``raw_label``
    (``{write}`` and ``{read}``: the raw contenders' names); ``lead``: cells
    put before each row's."""
    (bw, bw_name), (br, br_name) = profile["raw"]["save"], profile["raw"]["load"]
    rows = []
    for c in profile["contenders"]:
        warm = "" if c["cold"] or c["load"] is None else " (warm)"
        rows.append([c["name"], _gbps(c["save"]), _ratio(c["save"], bw), _gbps(c["load"]) + warm,
                     _ratio(c["load"], br)])
    rows.append([raw_label.format(write=bw_name or "-", read=br_name or "-"), _gbps(bw), "1.00x", _gbps(br), "1.00x"])
    return ["| " + " | ".join([*lead, *cells]) + " |" for cells in rows]


def markdown(profiles: list[dict[str, Any]]) -> str:
    """The figures of the plot as a Markdown table (GB/s = 10^9 B/s, medians)."""
    lines = ["| device profile | contender | save GB/s | save / device best | cold load GB/s | load / device best |",
             "| --- | --- | --- | --- | --- | --- |"]
    for p in profiles:
        lines += figure_rows(p, "**device best** (raw: write {write}, read {read})", (f"{p['device']}: {p['title']}",))
    sources = []
    for p in profiles:
        s = f"`{p['command']}` ({os.path.basename(p['source'])}, {p['timestamp']})"
        if s not in sources:
            sources.append(s)
    lines += ["", "Medians over the rounds of " + "; ".join(sources) + ". Regenerate the picture and this "
              "table: `python benchmarks/plot.py <json> --out docs/speed`. Raw = the fastest raw contender "
              "of the same run (fp_dcp's engine into huge pages, fio, or single-request Python O_DIRECT: "
              "see benchmarks/README.md)."]
    return "\n".join(lines) + "\n"


def plot(profiles: list[dict[str, Any]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(profiles)
    fig, axes = plt.subplots(n, 1, figsize=(9, 3.2 * n + 0.6), squeeze=False)
    colors = {"save": "#1f77b4", "load": "#ff7f0e"}
    for ax, p in zip(axes[:, 0], profiles):
        names = [c["name"] for c in p["contenders"]]
        x = range(len(names))
        width = 0.38
        for k, op in enumerate(("save", "load")):
            vals = [c[op] or 0.0 for c in p["contenders"]]
            best = p["raw"][op][0]
            pos = [i + (k - 0.5) * width for i in x]
            bars = ax.bar(pos, vals, width, color=colors[op],
                          label=f"{'save' if op == 'save' else 'cold load'}")
            for b, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:.2f}" + (f"\n{v / best:.2f}x" if best else ""),
                                (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
            if best:
                ax.axhline(best, color=colors[op], linestyle="--", linewidth=1,
                           label=f"device best {'write' if op == 'save' else 'read'} {best:.2f}")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names)
        ax.set_ylabel("GB/s")
        top = max([c[o] or 0 for c in p["contenders"] for o in ("save", "load")]
                  + [p["raw"][o][0] or 0 for o in ("save", "load")] + [0.1])
        ax.set_ylim(0, top * 1.3)
        ax.set_title(f"{p['device']}: {p['title']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.suptitle("dcp.save / dcp.load throughput (median GB/s; label: GB/s and ratio to the device's best)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def newest_json() -> str | None:
    found = sorted(glob.glob(os.path.join(REPO, "bench_out", "save_load-*.json")), key=os.path.getmtime)
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Details: the module's docstring and benchmarks/README.md.")
    ap.add_argument("json", nargs="*", help="bench_save_load.py JSON files (default: the newest in bench_out/)")
    ap.add_argument("--out", help="output path without suffix (default: the first JSON's, beside it)")
    args = ap.parse_args(argv)
    paths = args.json or ([newest_json()] if newest_json() else [])
    if not paths:
        print("plot: no JSON given and none in bench_out/: run python benchmarks/bench_save_load.py first",
              file=sys.stderr)
        return 2
    try:
        profiles = load_profiles(paths)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    if not profiles:
        print(f"plot: {', '.join(paths)} hold no mix", file=sys.stderr)
        return 2
    out = args.out or os.path.splitext(paths[0])[0]
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(markdown(profiles))
    print(f"table: {out}.md")
    try:
        plot(profiles, out + ".png")
    except ImportError as e:
        print(f"plot: no PNG ({e}); the plot needs matplotlib, a benchmark extra: pip install -e \".[bench]\"",
              file=sys.stderr)
        return 1
    print(f"plot: {out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
