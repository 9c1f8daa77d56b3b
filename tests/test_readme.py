"""The README and the docs stay accurate: the README fits two screens and
every code block in it runs as written; on every page users read (the
README, benchmarks/README.md, docs/*.md) links stay inside the repository,
every script, sub-command and flag shown exists, every file of the
repository named and every cited JSON is there, and no page carries dates
or issue numbers; every option is in docs/OPTIONS.md's table."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from fp_dcp.options import FastPersistOptions
from tests import _docblocks as docs

REPO = docs.REPO
README = open(os.path.join(REPO, "README.md")).read()
PAGES = ["README.md", "benchmarks/README.md"] + sorted(
    "docs/" + name for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md"))


def _text(page: str) -> str:
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def test_readme_fits_two_screens():
    assert len(README) <= 12_000, len(README)


@pytest.mark.parametrize("page", PAGES)
def test_every_link_points_inside_the_repository(page):
    text = _text(page)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page != "README.md"
    for link in links:
        if re.match(r"[a-z]+://", link) or link.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(REPO, os.path.dirname(page), link.split("#")[0]))
        assert path.startswith(REPO + os.sep), f"{page}: {link}: outside the repository"
        assert os.path.exists(path), f"{page}: {link}: no such file in the repository"


@pytest.mark.parametrize("page", PAGES)
def test_no_dates_issue_numbers_or_missing_json(page):
    text = _text(page)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{page}: a date"
    assert not re.search(r"\b[Ii]ssues? #?\d+", text), f"{page}: an issue number"
    assert "bench_out/" not in text, f"{page}: cites bench_out/, which is not in the repository"
    for cited in re.findall(r"[~$\w/.-]+\.json\b", text):
        placeholder = cited.startswith(("~", "$")) or any(  # OUT/x.json, docs/speed/NAME.json: the reader's
            part.isupper() for part in cited[:-len(".json")].split("/"))
        if "/" in cited and not placeholder:
            assert os.path.exists(os.path.join(REPO, cited)), f"{page}: {cited} is not in the repository"


def _commands(text: str) -> list[str]:
    """Every ``python benchmarks/X.py ...``, ``python tools/X.py ...`` and
    ``fp-dcp SUB ...`` a page shows in code, one line each (continuations
    joined, comments and what follows ``&&``, ``|`` or ``;`` cut off)."""
    pieces = []
    for code in re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M):
        pieces += code.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.S | re.M)
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    found = []
    for piece in pieces:
        for m in re.finditer(r"(python3? (?:benchmarks|tools)/[\w.]+\.py|fp-dcp [a-z][a-z-]*)(.*)", piece):
            found.append((m.group(1) + re.split(r"\s#|&&|\||;", m.group(2))[0]).strip())
    return found


_HELP: dict[str, str] = {}


def _help(program: str) -> str:
    """The ``--help`` text of a script or an ``fp-dcp`` sub-command."""
    import subprocess
    import sys

    if program not in _HELP:
        args = ([sys.executable, "-m", "fp_dcp", program.split()[1]] if program.startswith("fp-dcp ")
                else [sys.executable, program.split()[1]])
        r = subprocess.run(args + ["--help"], cwd=REPO, env=docs.ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{program} --help exited {r.returncode}: {r.stderr[-2000:]}"
        _HELP[program] = r.stdout
    return _HELP[program]


@pytest.mark.parametrize("page", PAGES)
def test_every_command_a_page_shows_exists_and_takes_its_flags(page):
    """A script a page tells the reader to run is in the repository, and every
    flag the page gives it is one its ``--help`` lists."""
    for command in _commands(_text(page)):
        program = " ".join(command.split()[:2])
        if program.startswith(("python ", "python3 ")):
            assert os.path.exists(os.path.join(REPO, program.split()[1])), f"{page}: {command}: no such script"
        helptext = _help(program)
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command[len(program):]):
            assert re.search(re.escape(flag) + r"(?![\w-])", helptext), \
                f"{page}: {command}: {program} --help lists no {flag}"


@pytest.mark.parametrize("page", PAGES)
def test_every_file_of_the_repository_a_page_names_exists(page):
    """A page that names a script, module or page of the repository by its
    path (``benchmarks/X.py``, ``fp_dcp/tools/tune.py``) names one that is
    there; NAME-style parts are placeholders."""
    top = "benchmarks|tools|fp_dcp|tests|cython_io|docs"
    for path in set(re.findall(rf"(?<![\w/.~$-])((?:{top})/[\w/.-]+\.(?:py|pyx|pxi|pyi|c|h|md|sh|json))\b",
                               _text(page))):
        if not any(part.isupper() for part in path.rsplit(".", 1)[0].split("/")):
            assert os.path.exists(os.path.join(REPO, path)), f"{page}: {path}: no such file in the repository"


def test_every_option_is_in_the_options_table():
    rows = [ln for ln in _text("docs/OPTIONS.md").splitlines() if ln.startswith("| `")]
    named = {name for ln in rows for name in re.findall(r"`([a-z_]+)`", ln.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(FastPersistOptions)}
    assert fields - named == set()
    assert named - fields == set()


def test_setup_and_test_commands_are_what_ci_runs():
    bash = [code.strip() for lang, code in docs.blocks("README.md") if lang == "bash"]
    setup, tests = bash[0], bash[1]
    assert setup.startswith("pip install torch==") and setup.endswith("&& python tools/demo.py")
    assert tests == "python -m pytest -q"
    ci = _text(".ci/run")
    assert re.search(r"-m pytest -q\s*$", ci, re.M), "CI no longer runs the README's test command"
    assert 'pip install -q -e ".[test,bench,frameworks]"' in ci
    assert 'pip install -e ".[test,bench,frameworks]"' in README


@pytest.mark.slow  # a 2-rank torchrun and a few fresh processes: about 40 s on 2 busy cores
def test_every_readme_block_runs_as_written(tmp_path):
    """The Python blocks run in order in one process (as a reader pastes them),
    the script blocks with their command, then the tools block's commands on
    the checkpoints they left; the two setup blocks are checked against CI
    above and the demo is run by tests/test_demo.py."""
    blocks = docs.blocks("README.md")
    session, scripts, tools = [], [], []
    for lang, code in blocks:
        if lang == "python":
            (scripts if docs.script(code) else session).append(code)
        elif lang == "bash" and code.startswith("fp-dcp "):
            tools += [ln.split("#")[0].strip() for ln in code.splitlines() if ln.strip()]
        else:
            assert lang == "bash" and code.startswith(("pip install torch==", "python -m pytest")), code
    assert len(session) >= 3 and scripts and tools
    (tmp_path / "readme_session.py").write_text("\n".join(session))
    docs.run(docs.argv("python readme_session.py"), str(tmp_path))
    for code in scripts:
        docs.run_script(code, str(tmp_path))
    for command in tools:
        docs.run(docs.argv(command), str(tmp_path))
    from fp_dcp._dcp_hooks import checkpoint_kind

    for ckpt in ("ckpt/step100", "ckpt/step200", "ckpt/step300", "ckpt/sharded"):
        assert checkpoint_kind(str(tmp_path / ckpt)) == "fp_dcp", ckpt
    assert checkpoint_kind(str(tmp_path / "stock_ckpt")) == "stock"
    assert (tmp_path / "model.safetensors").stat().st_size > 256 * 256 * 4


def test_speed_page_is_what_its_generator_makes_of_the_json_in_the_repository(tmp_path):
    """docs/SPEED.md is never edited by hand: the command it records, run
    again on the JSON it names (kept in the repository), gives the same page."""
    import shlex
    import subprocess
    import sys

    text = _text("docs/SPEED.md")
    m = re.search(r"`python tools/speed_report\.py ([^`]+)`", text)
    assert m, "docs/SPEED.md does not say how it was made"
    args = shlex.split(m.group(1))
    for a in args:
        if a.endswith(".json"):
            assert os.path.exists(os.path.join(REPO, a)), f"{a}: not in the repository"
    out = tmp_path / "SPEED.md"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "speed_report.py"), *args, "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    assert out.read_text() == text
