"""The code blocks of a Markdown page, and a way to run them as written.

A Python block whose first line is ``# NAME.py, run with: COMMAND`` is a whole
script: it is saved as NAME.py and run with COMMAND (``torchrun`` is this
Python's ``-m torch.distributed.run``, so the tree under test is the one run).
A shell line's ``fp-dcp`` is this Python's ``-m fp_dcp``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = re.compile(r"# (\w+\.py), run with: (.+)\n")
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def blocks(page: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``page`` (a path under the repository), in order."""
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    found = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    assert text.count("```") == 2 * len(found), f"{page}: a code fence is not closed"
    return found


def script(code: str) -> tuple[str, str] | None:
    """(file name, command) of a script block, else None."""
    m = SCRIPT.match(code)
    return (m.group(1), m.group(2)) if m else None


def argv(command: str) -> list[str]:
    args = shlex.split(command)
    if args[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"] + args[1:]
    if args[0] == "fp-dcp":
        return [sys.executable, "-m", "fp_dcp"] + args[1:]
    if args[0] == "python":
        return [sys.executable] + args[1:]
    return args


def run(args: list[str], cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def run_script(code: str, cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Save a script block in ``cwd`` and run it with the command on its first line."""
    name, command = script(code)
    with open(os.path.join(cwd, name), "w") as f:
        f.write(code)
    return run(argv(command), cwd, timeout)
