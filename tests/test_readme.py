"""The README stays accurate: links inside the repository, every option in
the options table, every cited bench_out/ JSON beside the command that
regenerates it."""

from __future__ import annotations

import dataclasses
import os
import re

from fp_dcp.options import FastPersistOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()


def test_every_link_points_inside_the_repository():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link) or link.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(REPO, link.split("#")[0]))
        assert path.startswith(REPO + os.sep), f"{link}: outside the repository"
        assert os.path.exists(path), f"{link}: no such file in the repository"
    assert "../" not in README


def test_every_option_is_in_the_options_table():
    rows = [ln for ln in README.splitlines() if ln.startswith("| `")]
    named = {name for ln in rows for name in re.findall(r"`([a-z_]+)`", ln.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(FastPersistOptions)}
    assert fields - named == set()


def test_cited_bench_out_files_come_with_their_command():
    for para in re.split(r"\n\s*\n", README):
        if re.search(r"bench_out/[\w.-]+\.json", para):
            assert "benchmarks/" in para, para
