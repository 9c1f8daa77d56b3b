"""Only the file layer (fp_dcp/files.py) touches paths: no other module of
fp_dcp calls ``open``, ``os.open``, a removal, a creation, a rename or a
listing itself.  The exceptions are listed below, each with its reason; the
native engine (``fp_dcp._native``, opened by path with ``O_NOFOLLOW`` and
checked with ``fstat``) is reached through method calls, not these names.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fp_dcp"

FORBIDDEN = {
    "os": {"open", "remove", "unlink", "rmdir", "removedirs", "makedirs", "mkdir", "rename", "renames",
           "replace", "listdir", "scandir", "walk", "symlink", "link", "truncate", "mkfifo"},
    "shutil": {"rmtree", "copy", "copy2", "copyfile", "copytree", "move"},
    "tempfile": {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile"},
    "io": {"open"},
    "builtins": {"open"},
}

# (module, call) -> why it may touch a path itself
ALLOWED = {
    ("_exit.py", "open"): "reads /proc/self/task/<tid>/comm, stat and syscall (this process's threads)",
    ("_exit.py", "os.listdir"): "lists /proc/self/task (this process's threads)",
    ("engine.py", "os.scandir"): "the O_DIRECT probe lists the directory for an existing regular file",
    ("engine.py", "os.open"): "the O_DIRECT probe opens that file O_NOFOLLOW|O_NONBLOCK and closes it at once",
    ("load/sharing/transport.py", "open"): "reads /proc/sys/kernel/random/boot_id",
    ("staging/arena.py", "os.open"): "the spill file (O_CREAT|O_EXCL, unlinked at once) and a peer's memfd "
                                     "through /proc/<pid>/fd",
    ("staging/arena.py", "os.makedirs"): "the spill directory the options name",
    ("staging/arena.py", "os.unlink"): "the spill file it just created exclusively",
    ("staging/stager.py", "os.makedirs"): "the spill directory the options name",
    ("tools/cli.py", "os.scandir"): "names only, for an error message's hint; opens nothing",
    ("tools/cli.py", "os.listdir"): "names only, for an error message's hint; opens nothing",
    ("tuning.py", "open"): "reads sysfs and /proc/cpuinfo, not a checkpoint path",
    ("tiers/restore.py", "os.link"): "a hard link between two directories held open (src_dir_fd, "
                                     "dst_dir_fd), the file itself not followed",
}


def path_calls(source: str) -> list[tuple[int, str]]:
    """(line, "module.name" or "open") of each forbidden call in ``source``,
    also through ``from os import unlink`` style imports and aliases."""
    tree = ast.parse(source)
    aliases = {m: m for m in FORBIDDEN}  # import os as _os -> {"_os": "os"}
    direct = {"open": "open"}  # from os import unlink as rm -> {"rm": "os.unlink"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in FORBIDDEN:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN:
            for a in node.names:
                if a.name in FORBIDDEN[node.module]:
                    direct[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in direct:
            out.append((node.lineno, direct[f.id]))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases:
            module = aliases[f.value.id]
            if f.attr in FORBIDDEN[module]:
                out.append((node.lineno, "open" if module in ("io", "builtins") else f"{module}.{f.attr}"))
    return out


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "files.py" or p.parent != PACKAGE)


def test_no_module_but_the_file_layer_touches_paths():
    bad = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for line, call in path_calls(path.read_text()):
            if (rel, call) not in ALLOWED:
                bad.append(f"fp_dcp/{rel}:{line}: {call}(...): use fp_dcp.files (Root) instead")
    assert not bad, "\n".join(bad)


def test_every_exception_is_still_needed():
    """An allow-list entry whose call is gone is removed, so the list stays true."""
    seen = set()
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        seen.update((rel, call) for _, call in path_calls(path.read_text()))
    stale = sorted(k for k in ALLOWED if k not in seen)
    assert not stale, f"allowed calls no longer made (remove them from ALLOWED): {stale}"


@pytest.mark.parametrize("source, found", [
    ("import os\nos.unlink('x')", [(2, "os.unlink")]),
    ("import os as o\no.replace('a', 'b')", [(2, "os.replace")]),
    ("from os import makedirs as md\nmd('x')", [(2, "os.makedirs")]),
    ("import shutil\nshutil.rmtree('x')", [(2, "shutil.rmtree")]),
    ("open('x')", [(1, "open")]),
    ("import io\nio.open('x')", [(2, "open")]),
    ("import os\nos.fstat(3)\nroot.unlink('x')", []),
])
def test_the_check_sees_every_spelling(source, found):
    assert path_calls(source) == found
