"""tools/demo.py end to end at a small size: exit code, the lines it prints in
the order it runs its steps, progress on stderr, what it keeps with --keep,
the `next:` hint pointing at a checkpoint that fp-dcp inspects and verifies;
and without --keep, nothing left behind and nothing written outside the
temporary directory or --dir."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fp_dcp.tools.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "tools", "demo.py")
_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}

NUM = r"\d+\.\d+"


@pytest.mark.slow  # CI runs it (the whole suite); about 15 s
def test_demo_end_to_end_small(tmp_path, capsys):
    d = tmp_path / "kept"
    r = subprocess.run([sys.executable, DEMO, "--size", "16MiB", "--ranks", "2", "--dir", str(d), "--keep"],
                       capture_output=True, text=True, env=_ENV, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    expected = [
        rf"fp_dcp \S+ demo: a {NUM} MiB model \(\d+ tensors \+ 1 other item\), under {re.escape(str(d))}$",
        rf"writes about {NUM} MiB there, keeps the checkpoints \(--keep\)$",
        r"GB/s = 10\^9 bytes",
        r"raw device, no checkpoint format \(.* sequential, (O_DIRECT|buffered)\), in the order run:$",
        rf"  raw write  \w+ 1 MiB x 64: {NUM}   \w+ 4 MiB x 16: {NUM}   \w+ 16 MiB x 4: {NUM}.*   best {NUM} GB/s$",
        rf"  raw read   \w+ 1 MiB x 64: {NUM}   \w+ 4 MiB x 16: {NUM}   \w+ 16 MiB x 4: {NUM}.*   best {NUM} GB/s$",
        r"dcp.save, 2 ranks, Shard\(0\) DTensors, in the order run:$",
        rf"  fp_dcp FastPersistWriter \((aio|uring|threads)\) +{NUM} s +{NUM} GB/s  {NUM}x raw write$",
        rf"    of which moving the bytes +{NUM} s +{NUM} GB/s  {NUM}x raw write; fixed cost per checkpoint .* {NUM} s$",
        rf"  stock  FileSystemWriter +{NUM} s +{NUM} GB/s  {NUM}x raw write$",
        rf"  fp_dcp saves at {NUM}x the stock writer's speed$",
        r"dcp.async_save with fp_dcp \(staging=eager\), in the order run:$",
        rf"  first  returned after +{NUM} ms; training may step after +{NUM} ms; committed after +{NUM} s",
        rf"  steady returned after +{NUM} ms; training may step after +{NUM} ms; committed after +{NUM} s$",
        r"resharded load, 2 ranks' Shard\(0\) slices -> whole tensors in 1 process, .*, in the order run:$",
        rf"  fp_dcp FastPersistReader +{NUM} s +{NUM} GB/s  {NUM}x raw read   bit-exact  every block's CRC-32C checked$",
        rf"    of which moving the bytes +{NUM} s +{NUM} GB/s  {NUM}x raw read; fixed cost per checkpoint .* {NUM} s$",
        rf"  stock  FileSystemReader +{NUM} s +{NUM} GB/s  {NUM}x raw read   bit-exact$",
        rf"  fp_dcp loads at {NUM}x the stock reader's speed$",
        r"done in \d+ s\.$",
        rf"kept: {re.escape(str(d))} \(fp/, stock/, fp_async_first/, fp_async_steady/\)$",
        rf"next: fp-dcp inspect {re.escape(str(d / 'fp'))}, fp-dcp verify {re.escape(str(d / 'fp'))}$",
    ]
    got = [ln for ln in lines if ln.strip()]
    assert len(got) == len(expected), r.stdout
    for pattern, line in zip(expected, got):
        assert re.match(pattern, line), (pattern, line)
    # progress on stderr, one line per long step, in the order run
    steps = [re.sub(r"^\[demo +\d+\.\d s\] ", "", ln) for ln in r.stderr.splitlines() if ln.startswith("[demo")]
    order = ["writing under", "importing torch", "generating the model", "raw device write", "raw device read",
             "starting 2 ranks", "dcp.save with fp_dcp", "dcp.save with the stock", "dcp.async_save with fp_dcp, first",
             "dcp.async_save with fp_dcp, steady", "dcp.load with FastPersistReader", "comparing every tensor",
             "dcp.load with FileSystemReader", "comparing every tensor"]
    at = 0
    for s in steps:
        if at < len(order) and s.startswith(order[at]):
            at += 1
    assert at == len(order), steps
    # kept what --dir asked for, removed only its own scratch files
    assert sorted(os.listdir(d)) == ["fp", "fp_async_first", "fp_async_steady", "stock"]
    assert cli_main(["verify", "-q", str(d / "fp")]) == 0
    assert cli_main(["inspect", str(d / "fp")]) == 0
    out = capsys.readouterr().out
    assert "on 2 ranks" in out and "1 other item" in out
    # a second run into the same --dir refuses, and deletes nothing
    r = subprocess.run([sys.executable, DEMO, "--size", "16MiB", "--dir", str(d)], capture_output=True, text=True,
                       env=_ENV, timeout=120)
    assert r.returncode == 1 and "already holds fp, stock, fp_async_first, fp_async_steady" in r.stderr
    assert sorted(os.listdir(d)) == ["fp", "fp_async_first", "fp_async_steady", "stock"]


def _tree(top):
    return sorted(os.path.relpath(os.path.join(dp, n), top) for dp, dns, fns in os.walk(top) for n in dns + fns)


def _demo_dirs():
    """fp_dcp demo directories in the places an old demo wrote to by default."""
    return {os.path.join(top, n) for top in ("/tmp", "/work") if os.path.isdir(top)
            for n in os.listdir(top) if "fp_dcp_demo" in n}


@pytest.mark.slow  # CI runs it (the whole suite); two small runs, about 30 s
def test_demo_leaves_nothing_behind_and_writes_nowhere_else(tmp_path):
    """Without --keep: under $TMPDIR, then in a --dir that holds a file of the
    user's; $TMPDIR, $HOME, the working directory and that file are as they were."""
    tmp, home, cwd, mine = (tmp_path / n for n in ("tmp", "home", "cwd", "mine"))
    for p in (tmp, home, cwd, mine):
        p.mkdir()
    (mine / "precious.txt").write_bytes(b"not the demo's")
    env = {**_ENV, "TMPDIR": str(tmp), "HOME": str(home)}
    before = _demo_dirs()
    for extra in ([], ["--dir", str(mine)]):
        r = subprocess.run([sys.executable, DEMO, "--size", "16MiB"] + extra, capture_output=True, text=True,
                           env=env, cwd=cwd, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        where = str(mine) if extra else str(tmp)
        said = re.search(r"writing under (\S+): about", r.stderr)
        assert said and said.group(1).startswith(where), r.stderr
        assert re.search(rf"under {re.escape(where)}.*\nwrites about {NUM} MiB there, removes it all", r.stdout)
        assert _tree(tmp) == [] and _tree(home) == [] and _tree(cwd) == [], (_tree(tmp), _tree(home), _tree(cwd))
        assert _tree(mine) == ["precious.txt"] and (mine / "precious.txt").read_bytes() == b"not the demo's"
    assert _demo_dirs() == before
