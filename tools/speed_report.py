"""docs/SPEED.md from benchmark JSON: every figure beside the command that
made it, the device, the device profile and the raw reference of that run.

    python tools/speed_report.py docs/speed/save_load-1g.json [--note TEXT] [--out docs/SPEED.md]

Reads bench_save_load.py JSON (one file per run, any mixes and profiles).
The page is generated: change it by running the benchmark again and this
script on its JSON, never by hand.  --note adds one sentence about the run
(the conditions the JSON cannot know, e.g. that the machine was busy); the
page records this script's command line, notes included, so the same command
regenerates it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import plot  # noqa: E402  (benchmarks/plot.py: the JSON's per-profile figures)

PROFILE_WORDS = {
    "bare": "the disk as it is",
    "throttled": "the same disk limited per operation by a cgroup v1 blkio group",
    "ram": "ext4 on a loop device over RAM: a fast device whose speed is the CPU's",
}


def _rel(path: str) -> str:
    p = os.path.relpath(os.path.abspath(path), REPO)
    return p if not p.startswith("..") else path


def bench_command(report: dict[str, Any], json_path: str) -> str:
    """The benchmark's command line, with this JSON's place in the repository
    as --json and the run's scratch directory left out."""
    args, out, skip = list(report.get("argv", [])), [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--json", "--dir"):
            skip = True
            continue
        if a.startswith(("--json=", "--dir=")):
            continue
        out.append(a)
    return "python benchmarks/bench_save_load.py " + shlex.join(out + ["--json", _rel(json_path)])


def _profile_text(report: dict[str, Any], name: str) -> str:
    words = PROFILE_WORDS.get(name, name)
    for p in report.get("profiles") or []:
        if p.get("profile") == name and p.get("read_iops"):
            words += f" to {p['read_iops']:,} reads and {p.get('write_iops', p['read_iops']):,} writes per second"
    return f"`{name}` ({words})"


def _device_text(report: dict[str, Any]) -> str:
    """The device the run measured: the disk under its --dir, or, where every
    profile of the run is ``ram``, the file system in RAM it made instead."""
    names = {m.get("profile", "bare") for m in report.get("mixes", [])}
    if names == {"ram"}:
        size = next((p.get("fs_bytes") for p in report.get("profiles") or [] if p.get("fs_bytes")), None)
        cores = report.get("hardware", {}).get("cpu_cores", "?")
        return f"ext4 of {plot._size(size)} on a loop device over RAM, {cores} cores"
    return plot.device_label(report.get("hardware", {}))


def _ratio_rows(mix: dict[str, Any]) -> dict[tuple[str, str], dict]:
    return {(r["op"], r["vs"]): r for r in mix.get("ratios", []) if r.get("contender") == "fp_dcp"}


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def mix_table(mix: dict[str, Any], profile: dict[str, Any]) -> list[str]:
    """One table: each contender's medians and ratios, then the raw reference."""
    lines = ["| contender | save GB/s | save, x raw write | cold load GB/s | load, x raw read |",
             "| --- | --- | --- | --- | --- |"]
    lines += plot.figure_rows(profile, "raw reference (write: {write}; read: {read})")
    rows = _ratio_rows(mix)
    notes = []
    for op, vs, what in (("save", "stock default", "fp_dcp saves at {} the stock writer's speed"),
                         ("load", "stock reader", "loads at {} the stock reader's")):
        r = rows.get((op, vs))
        if r and r.get("ratio"):
            notes.append(what.format(_x(r["ratio"])))
    for op in ("save", "load"):
        r = rows.get((op, "ceiling: raw + DCP's own time, any storage"))
        if r and r.get("ratio"):
            notes.append(f"no DCP storage could {op} faster than {_x(r['ratio'])} of raw in this run "
                         f"with DCP's default planners (the raw transfer plus DCP's own time, `dcp_floor`)")
        r = rows.get((op, "ceiling: raw + DCP's own time with fp_dcp's planners"))
        if r and r.get("ratio"):
            notes.append(f"with fp_dcp's planners, {_x(r['ratio'])} (`dcp_floor_fp`)")
    paired = [r for r in mix.get("ratios", []) if r.get("contender") == "fp_dcp"
              and str(r.get("vs", "")).startswith("paired raw") and r.get("value")]
    if paired:  # the disk's speed drifts over a run: each round against the raw transfers around it
        notes.append("against raw transfers of as many bytes just before and after each of its rounds: "
                     + ", ".join(f"{r['op']} {r['value']}" for r in paired))
    for key, what in ((("load", "verify off (same checkpoint, back to back; worst round)"),
                       "verified loads against unverified ones of the same checkpoint: {}"),):
        r = rows.get(key)
        if r and r.get("value"):
            notes.append(what.format(r["value"]))
    if notes:
        lines += ["", "; ".join(notes) + "."]
    return lines


def page(paths: list[str], notes: list[str], argv: list[str]) -> str:
    out = ["# Speed", "",
           "Generated from the benchmarks' JSON by `python tools/speed_report.py " + shlex.join(argv) + "`; "
           "not edited by hand. GB/s = 10^9 bytes of tensors per second, medians over the rounds of each run. "
           "Ratios compare figures of the same run and device profile only. Raw reference: the fastest raw "
           "contender of the same run and profile (fio with libaio and `O_DIRECT`, fp_dcp's engine into one "
           "huge-page buffer, or single-request Python `O_DIRECT` where fio is missing: "
           "[`benchmarks/README.md`](../benchmarks/README.md)). Stock: DCP's `FileSystemWriter` / "
           "`FileSystemReader`.", ""]
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        profiles = plot.load_profiles([path])
        hw = report.get("hardware", {})
        out += [f"## `{_rel(path)}`", "",
                "Command: `flock /tmp/fp_dcp_bench.lock " + bench_command(report, path) + "`", "",
                f"Device: {_device_text(report)} ({hw.get('cpu_model', '?')}, "
                f"{plot._size(hw.get('ram_bytes'))} RAM, torch {hw.get('torch', '?')}); loads "
                + ("cold (page cache dropped before each)" if report.get("cold_loads") else "WARM (page cache kept)")
                + f"; {report.get('repeat', '?')} round(s), contenders alternating within a round; raw contenders: "
                + ", ".join(c["name"] for c in report.get("contenders", []) if c.get("role") == "raw")
                + f" (`--raw {report.get('raw_method', '?')}`).", ""]
        out += [f"Note: {n}" for n in notes] + ([""] if notes else [])
        for mix, prof in zip(report.get("mixes", []), profiles):
            objects = mix.get("objects")
            what = (f"{plot.MIX_NAMES.get(mix['mix'], mix['mix'])}: {mix.get('tensors', '?'):,} tensors"
                    + (f" + {objects:,} object{'s' if objects != 1 else ''}" if objects else "")
                    + f", {plot._size(mix.get('payload_bytes'))}")
            out += [f"### {what}, profile {_profile_text(report, mix.get('profile', 'bare'))}", ""]
            out += mix_table(mix, prof) + [""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench_save_load.py JSON files, each kept in the repository")
    ap.add_argument("--note", action="append", default=[], help="a sentence about the runs (repeatable)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "SPEED.md"))
    args = ap.parse_args(argv)
    shown = [a for a in argv]
    if "--out" in shown:  # the page's own place is not part of what it says
        i = shown.index("--out")
        del shown[i:i + 2]
    text = page(args.json, args.note, shown)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
