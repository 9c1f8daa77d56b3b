"""The file layer (fp_dcp.files): nothing beneath a root is reached through a
link, nothing but a regular file is read, nothing outside is ever touched.

Every test runs with ``openat2`` and with the component walk that replaces it
on kernels without it; a canary outside the root keeps its bytes and mtime.
"""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from fp_dcp import files
from fp_dcp import format as fmt
from tests._canary import assert_canary as _assert_canary
from tests._canary import canary as _canary


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    if request.param == "walk":
        monkeypatch.setattr(files, "_openat2_state", [None])
    elif files._openat2() is None:
        pytest.skip("this kernel has no openat2")
    return request.param




@pytest.fixture
def tree(tmp_path):
    """root/a/b/f (a file), and outside/ with a canary file and a canary dir."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"inside")
    out = tmp_path / "outside"
    (out / "d").mkdir(parents=True)
    canaries = [_canary(out / "f"), _canary(out / "d" / "f")]
    yield root, out
    for c in canaries:
        _assert_canary(c)
    assert sorted(os.listdir(out)) == ["d", "f"] and os.listdir(out / "d") == ["f"]


# the relative paths a caller may use, with a link planted at each component
_LINKED = ["a", "a/b"]


@pytest.mark.parametrize("component", _LINKED)
def test_a_link_in_any_component_is_refused_by_every_operation(tree, resolver, component):
    root, out = tree
    target = root / component
    os.rename(target, str(target) + ".real")
    os.symlink(out if component == "a" else out, target)  # a link to a directory outside, holding d/ and f
    rel = f"{component}/d/f" if component == "a/b" else "a/d/f"
    with files.Root(root) as r:
        for op in (lambda: r.read_bytes(rel, 1 << 20), lambda: r.lstat(rel), lambda: r.unlink(rel),
                   lambda: r.replace_bytes(rel, b"x"), lambda: r.mkdir(rel + "2", parents=True),
                   lambda: r.entries(component), lambda: r.rename(rel, "stolen"), lambda: r.sub(component),
                   lambda: r.create_exclusive(rel + "2"), lambda: r.rmtree(component + "/d")):
            with pytest.raises(files.UnsafePathError) as info:
                op()
            assert str(root) in str(info.value)


def test_a_link_as_the_last_component(tree, resolver):
    root, out = tree
    os.symlink(out / "f", root / "a" / "link")
    with files.Root(root) as r:
        with pytest.raises(files.UnsafePathError):
            r.read_bytes("a/link", 1 << 20)
        with pytest.raises(FileExistsError):
            r.create_exclusive("a/link")
        with pytest.raises(files.UnsafePathError, match="symbolic link is where fp_dcp makes a directory"):
            r.mkdir("a/link")
        assert r.lstat("a/link").st_mode & stat.S_IFMT(0o170000) == stat.S_IFLNK
        r.replace_bytes("a/link", b"replaced")  # the link itself is replaced, its target untouched
        assert (root / "a" / "link").read_bytes() == b"replaced" and not (root / "a" / "link").is_symlink()


@pytest.mark.parametrize("rel", ["../outside/f", "/etc/passwd", "a/../../outside/f", "a//b/f", "a/./b/f", ""])
def test_paths_that_leave_or_are_not_plain_are_refused(tree, rel):
    root, _ = tree
    with files.Root(root) as r:
        with pytest.raises((files.UnsafePathError, IsADirectoryError, files.NotRegularFileError)):
            r.read_bytes(rel, 1 << 20)


def test_root_that_is_a_link_refused_only_when_asked(tree):
    root, out = tree
    os.symlink(out, root / "ln")
    with pytest.raises(files.UnsafePathError, match="is a symbolic link"):
        files.Root(root / "ln", follow=False)
    with files.Root(root / "ln") as r:  # a path the user gave: followed
        assert r.read_bytes("f", 1 << 20).startswith(b"canary")


def test_fifo_device_socket_and_directory_are_refused_without_blocking(tree, resolver):
    root, _ = tree
    os.mkfifo(root / "fifo")
    os.symlink("/dev/zero", root / "devlink")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(root / "sock"))
    done = []

    def run():
        with files.Root(root) as r:
            for name in ("fifo", "sock", "a"):
                with pytest.raises(files.NotRegularFileError) as info:
                    r.read_bytes(name, 1 << 20)
                assert name in str(info.value)
            with pytest.raises(files.UnsafePathError):
                r.read_bytes("devlink", 1 << 20)
        with files.Root("/dev") as r:
            with pytest.raises(files.NotRegularFileError, match="character device"):
                r.read_bytes("zero", 1 << 20)
        done.append(True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    s.close()
    assert done == [True], "a read of a FIFO, socket or device blocked or failed otherwise"


def test_sparse_oversized_file_is_refused_before_reading(tree, resolver):
    root, _ = tree
    with open(root / "big", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: reading it would never end
    with files.Root(root) as r:
        with pytest.raises(files.FileTooLargeError, match="1099511627776 bytes"):
            r.read_bytes("big", 1 << 20)
        assert r.read_bytes("a/b/f", 6) == b"inside"
        with pytest.raises(files.FileTooLargeError):
            r.read_bytes("a/b/f", 5)


def test_sparse_metadata_is_refused_by_its_header_before_a_whole_read(tmp_path, monkeypatch):
    d = tmp_path / "c"
    d.mkdir()
    with open(d / fmt.METADATA_NAME, "wb") as f:
        f.write(b"NOTMAGIC" + bytes(16))
        f.truncate(1 << 30)
    reads = []
    real = os.read
    monkeypatch.setattr(files.os, "read", lambda fd, n: reads.append(n) or real(fd, n))
    with pytest.raises(fmt.CheckpointFormatError, match="bad magic"):
        files.read_metadata_bytes(str(d))
    assert reads == []  # only the header, by pread


def test_metadata_whose_size_disagrees_with_its_header_is_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    header = fmt._HEADER.pack(fmt._MAGIC, fmt.FORMAT_VERSION, 0, 10)
    (d / fmt.METADATA_NAME).write_bytes(header + b"x" * 11)
    with pytest.raises(fmt.CheckpointFormatError, match="trailing bytes"):
        files.read_metadata_bytes(str(d))


@pytest.mark.parametrize("kind", ["fifo", "link", "dir"])
def test_metadata_that_is_not_a_regular_file_is_named(tmp_path, kind):
    d = tmp_path / "c"
    d.mkdir()
    canary = _canary(tmp_path / "canary")
    p = d / fmt.METADATA_NAME
    {"fifo": lambda: os.mkfifo(p), "link": lambda: os.symlink(canary[0], p), "dir": lambda: p.mkdir()}[kind]()
    with pytest.raises(fmt.CheckpointFormatError) as info:
        files.read_metadata_bytes(str(d))
    assert str(p) in str(info.value)
    _assert_canary(canary)


def test_atomic_replace_leaves_no_temporary_on_failure(tree, resolver, monkeypatch):
    root, _ = tree
    with files.Root(root) as r:
        r.replace_bytes("a/b/f", b"new bytes")
        assert (root / "a" / "b" / "f").read_bytes() == b"new bytes"
        assert os.listdir(root / "a" / "b") == ["f"]

        def no_rename(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(files.os, "replace", no_rename)
        with pytest.raises(OSError, match="No space left"):
            r.replace_bytes("a/b/f", b"lost")
        monkeypatch.undo()
        assert os.listdir(root / "a" / "b") == ["f"] and (root / "a" / "b" / "f").read_bytes() == b"new bytes"

        def short_write(fd, data):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(files.os, "write", short_write)
        with pytest.raises(OSError, match=r"cannot write.*Input/output error") as info:
            r.replace_bytes("a/b/f", b"lost")
        assert str(root) in str(info.value.filename)
        monkeypatch.undo()
        assert os.listdir(root / "a" / "b") == ["f"]


def test_atomic_replace_never_writes_through_a_planted_temporary(tree, resolver):
    root, out = tree
    os.symlink(out / "f", root / "tmp-name")
    with files.Root(root) as r:
        with pytest.raises(FileExistsError):
            r.replace_bytes("x", b"data", tmp_name="tmp-name")
    assert not (root / "x").exists() and (root / "tmp-name").is_symlink()


def test_mkdir_makes_parents_and_refuses_what_is_not_a_directory(tree, resolver):
    root, out = tree
    with files.Root(root) as r:
        assert r.mkdir("p/q/r", parents=True) is True
        assert r.mkdir("p/q/r", parents=True) is False
        assert (root / "p" / "q" / "r").is_dir()
        with pytest.raises(FileNotFoundError):
            r.mkdir("n/o")
        with pytest.raises(files.UnsafePathError, match="regular file"):
            r.mkdir("a/b/f")
        os.symlink(out, root / "p" / "ln")
        with pytest.raises(files.UnsafePathError):
            r.mkdir("p/ln/new", parents=True)
        assert not (out / "new").exists()


def test_entries_report_the_lstat_kind(tree):
    root, out = tree
    os.symlink(out, root / "ln")
    os.mkfifo(root / "fifo")
    with files.Root(root) as r:
        assert sorted(r.entries()) == [("a", "dir"), ("fifo", "other"), ("ln", "link")]
        assert r.entries("a/b") == [("f", "file")]


def test_remove_owned_removes_only_what_the_caller_owns(tree, resolver):
    root, out = tree
    c = root / "ckpt"
    (c / "sub").mkdir(parents=True)
    for name in ("x.fpd", "y.fpd", "precious.txt", "sub/z.fpd"):
        (c / name).write_bytes(b"1")
    os.symlink(out, c / "link.fpd")  # owned by name: unlinked, never followed
    os.symlink(out, c / "linkdir")  # not owned: left
    with files.Root(root) as r:
        left = r.remove_owned("ckpt", lambda rel, kind: rel.endswith(".fpd") or (kind == "dir" and rel == "sub"))
    assert sorted(left) == ["linkdir", "precious.txt"]
    assert sorted(os.listdir(c)) == ["linkdir", "precious.txt"]
    with files.Root(root) as r:
        left = r.remove_owned("ckpt", lambda rel, kind: True)
    assert left == [] and not c.exists()


def test_remove_owned_refuses_a_linked_directory(tree, resolver):
    root, out = tree
    os.symlink(out, root / "ckpt")
    with files.Root(root) as r:
        with pytest.raises(files.UnsafePathError):
            r.remove_owned("ckpt", lambda rel, kind: True)
        with pytest.raises(files.UnsafePathError):
            r.rmtree("ckpt")
    assert (root / "ckpt").is_symlink()


def test_rmtree_does_not_follow_a_directory_swapped_for_a_link(tree, resolver):
    """The race of a classic rmtree: a directory replaced by a link between
    the listing and the descent.  The descent opens with O_NOFOLLOW from the
    held descriptor, so the link is removed as an entry, never entered."""
    root, out = tree
    (root / "t" / "d").mkdir(parents=True)
    (root / "t" / "d" / "f").write_bytes(b"1")
    real_scan = files._scan
    swapped = []

    def scan(fd):
        entries = list(real_scan(fd))
        if not swapped and ("d", "dir") in entries:
            os.rename(root / "t" / "d", root / "t-moved")
            os.symlink(out, root / "t" / "d")
            swapped.append(True)
        return iter(entries)

    files_scan = files._scan
    files._scan = scan
    try:
        with files.Root(root) as r:
            left = r.remove_owned("t", lambda rel, kind: True)
    finally:
        files._scan = files_scan
    assert swapped and left == ["d"]  # the link was not entered; left for a human


def test_a_root_is_confined_while_the_tree_above_moves(tree, resolver):
    """The held descriptor, not the path, is the root: renaming the root's
    path and planting a link there leads nothing outside."""
    root, out = tree
    with files.Root(root) as r:
        os.rename(root, str(root) + ".moved")
        os.symlink(out, root)
        assert r.read_bytes("a/b/f", 100) == b"inside"
        r.replace_bytes("g", b"new")
    assert (tree[0].parent / "root.moved" / "g").read_bytes() == b"new"
    os.unlink(root)


def test_read_small_file_refuses_a_fifo_and_a_link(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    canary = _canary(tmp_path / "canary")
    os.symlink(canary[0], tmp_path / "ln")
    with pytest.raises(files.NotRegularFileError, match="FIFO"):
        files.read_small_file(tmp_path / "fifo", 100)
    with pytest.raises(files.UnsafePathError):
        files.read_small_file(tmp_path / "ln", 1 << 20)
    assert files.read_small_file(canary[0], 1 << 20) == canary[1]
    _assert_canary(canary)


def test_link_or_copy_links_or_copies_and_never_follows(tree, resolver, monkeypatch):
    root, out = tree
    (root / "dst").mkdir()
    with files.Root(root) as r, files.Root(root / "dst") as d:
        r.link_or_copy("a/b/f", d, "linked")
        assert os.stat(root / "dst" / "linked").st_ino == os.stat(root / "a" / "b" / "f").st_ino
        real_link = os.link
        monkeypatch.setattr(files.os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(18, "cross-device")))
        r.link_or_copy("a/b/f", d, "copied")
        monkeypatch.setattr(files.os, "link", real_link)
        assert (root / "dst" / "copied").read_bytes() == b"inside"
        assert os.stat(root / "dst" / "copied").st_ino != os.stat(root / "a" / "b" / "f").st_ino
        os.symlink(out / "f", root / "a" / "ln")
        with pytest.raises(files.UnsafePathError):
            r.link_or_copy("a/ln", d, "stolen")
        os.symlink(out, root / "dst" / "sub")
        with pytest.raises(files.UnsafePathError):
            r.link_or_copy("a/b/f", d, "sub/planted")
    assert sorted(os.listdir(root / "dst")) == ["copied", "linked", "sub"]
