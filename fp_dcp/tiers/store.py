"""The tiers' directories on disk (docs/TIERS.md, "Where things live"): only
owned step directories (:func:`step_name` plus the marker) are ever read,
written or deleted, and in them only fp_dcp's regular files."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import uuid
from typing import Iterator

from fp_dcp import files
from fp_dcp import format as fmt

__all__ = ["TierPathError", "step_dir", "step_name", "parse_step", "node_root", "Holding", "scan", "steps",
           "claim_step", "claim_dir", "owned", "write_atomic", "read_small", "read_metadata", "RangesFile",
           "retain", "remove_owned", "real_dir", "RESTORE_DIR", "MARKER_NAME"]

_STEP = re.compile(r"step_([0-9]{9,18})", re.ASCII)
RESTORE_DIR = ".restore"
MARKER_NAME = ".fp_dcp.tier"
TMP_SUFFIX = ".tier-tmp"  # a file being written: never taken for a data file
_MAX_METADATA_BYTES = 1 << 31


class TierPathError(RuntimeError):
    """A tier directory holds an entry the tiers do not follow, open or
    delete: a symbolic link where a step directory or file belongs, a FIFO,
    socket or device, or a directory of a step's name that they did not
    create (the message names it and the fix)."""


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a directory name spelt as :func:`step_name` spells it
    (ASCII digits, that exact spelling), else ``None``."""
    m = _STEP.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def node_root(template: str, node: int) -> str:
    """A node's local root: ``template`` with ``{node}`` replaced (tests and
    single-machine runs give each node its own directory); on a cluster the
    same path on every node."""
    return template.replace("{node}", str(node))


def _marker_bytes(step: int | None) -> bytes:
    return b'{"fp_dcp_tier": 1, "step": %s}\n' % (b"null" if step is None else str(step).encode())


def _refused(path: str, kind: str) -> TierPathError:
    return TierPathError(f"{path}: {kind} in a tier directory; the tiers never write one, and neither "
                         f"follow nor open it: remove it")


def _kind(root: files.Root, name: str) -> str:
    try:
        mode = root.lstat(name).st_mode
    except OSError:
        return "not a regular file"
    return "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
        "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
        "a directory" if stat.S_ISDIR(mode) else "not a regular file"


@contextlib.contextmanager
def opened(path: str, *, user: bool = False) -> Iterator[files.Root]:
    """The tier directory ``path`` held open (:class:`fp_dcp.files.Root`):
    no link followed in it, nor, unless ``user`` (a root the caller named),
    at its last component (:class:`TierPathError`)."""
    try:
        root = files.Root(path, follow=user)
    except (files.UnsafePathError, NotADirectoryError):
        try:
            with files.Root(os.path.dirname(path) or ".") as parent:
                kind = _kind(parent, os.path.basename(path))
        except OSError:
            kind = "not a directory"
        raise _refused(path, kind) from None
    with root:
        yield root


@contextlib.contextmanager
def opened_sub(parent: files.Root, name: str) -> Iterator[files.Root]:
    """Directory ``name`` of ``parent`` held open, no link followed."""
    try:
        root = parent.sub(name)
    except (files.UnsafePathError, NotADirectoryError):
        raise _refused(parent.join(name), _kind(parent, name)) from None
    with root:
        yield root


def read_small(root: files.Root, name: str, limit: int) -> bytes:
    """Regular file ``name`` of ``root``, whole, at most ``limit`` bytes:
    opened without following a link and without blocking, its type checked
    on the open descriptor; anything but a regular file is a
    :class:`TierPathError` before a byte is read."""
    try:
        return root.read_bytes(name, limit)
    except files.FileTooLargeError as e:
        raise fmt.CheckpointFormatError(f"{root.join(name)}: {e.strerror}") from None
    except files.UnsafePathError:
        raise _refused(root.join(name), _kind(root, name)) from None


def _metadata_of(root: files.Root) -> bytes:
    """``root``'s metadata, its header and length checked before it is read whole."""
    path = root.join(fmt.METADATA_NAME)
    try:
        fd, st = root.open_read(fmt.METADATA_NAME, _MAX_METADATA_BYTES)
    except files.FileTooLargeError as e:
        raise fmt.CheckpointFormatError(f"{path}: {e.strerror}") from None
    except files.UnsafePathError:
        raise _refused(path, _kind(root, fmt.METADATA_NAME)) from None
    try:
        head = os.pread(fd, fmt.HEADER_SIZE, 0)
    finally:
        os.close(fd)
    _, _, length = fmt.read_header(head, path)
    if st.st_size != fmt.HEADER_SIZE + length:
        raise fmt.CheckpointFormatError(f"{path}: {st.st_size} bytes, its header says "
                                        f"{fmt.HEADER_SIZE + length}; the metadata is damaged")
    return read_small(root, fmt.METADATA_NAME, fmt.HEADER_SIZE + length)


def read_metadata(directory: str) -> bytes:
    """The metadata of a step directory (no link followed at or below it,
    nothing but a regular file opened, bounded size)."""
    with opened(directory) as root:
        return _metadata_of(root)


def real_dir(path: str) -> str:
    """``path``, when it is a directory and not a link (else :class:`TierPathError`)."""
    with opened(path):
        return path


def owned(root: files.Root, step: int | None) -> bool:
    """Whether the directory ``root`` holds the tiers' marker for ``step``."""
    try:
        return read_small(root, MARKER_NAME, 256) == _marker_bytes(step)
    except (FileNotFoundError, fmt.CheckpointFormatError):
        return False


def _tmp_name(name: str) -> str:
    return f"{name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"


def claim_dir(parent: str, name: str, step: int | None) -> str:
    """``parent/name`` as a directory the tiers own (made, then marked, when
    it is not there; several ranks may claim it at once).  A link, a
    non-directory or a directory the tiers did not make there is refused with
    :class:`TierPathError`, before anything is written into it."""
    path = os.path.join(parent, name)
    with opened(parent, user=True) as p:
        try:
            p.mkdir(name)
        except files.UnsafePathError:
            raise _refused(path, _kind(p, name)) from None
        with opened_sub(p, name) as d:
            if owned(d, step):
                return path
            others = [n for n, _ in d.entries() if not n.startswith(MARKER_NAME)]
            if others:
                raise TierPathError(
                    f"{path}: a directory of that name is already there and the tiers did not make it (no "
                    f"{MARKER_NAME} marker); they never write into or delete it: move it away, or give the "
                    f"tiers a root of their own")
            d.replace_bytes(MARKER_NAME, _marker_bytes(step), sync=True, tmp_name=_tmp_name(MARKER_NAME))
    return path


def claim_step(root: str, step: int) -> str:
    """Step ``step``'s directory under ``root`` (made when missing: the
    root is the caller's own path), claimed by :func:`claim_dir`."""
    files.Root(root, create=True).close()
    return claim_dir(root, step_name(step), step)


def steps(root: str) -> Iterator[tuple[int, str]]:
    """``(step, directory)`` of every directory under ``root`` spelt as a
    step (:func:`step_name`) that is a real directory, owned or not."""
    try:
        with opened(root, user=True) as r:
            entries = r.entries()
    except FileNotFoundError:
        return
    for name, kind in sorted(entries):
        s = parse_step(name)
        if s is not None and kind == "dir":
            yield s, os.path.join(root, name)


def owned_steps(root: str) -> Iterator[tuple[int, str]]:
    """The steps of :func:`steps` that carry the tiers' marker."""
    for s, path in steps(root):
        try:
            with opened(path) as d:
                mine = owned(d, s)
        except FileNotFoundError:
            continue
        if mine:
            yield s, path


@dataclasses.dataclass
class Holding:
    """What one owned step directory holds: the metadata's save id and file
    list (when the metadata is there and good) and the data files present,
    by size."""

    save_id: str | None
    meta_files: list[tuple[str, int]] | None
    files: dict[str, int]


def decode(blob: bytes, where: str) -> tuple:
    """A step's metadata decoded, with the tiers' confinement rule on top: every
    data file is a plain name this save's writer gives (nothing outside a step
    directory).  Every metadata the tiers read goes through here."""
    metadata, layout, extra = fmt.decode_metadata(blob, where)
    for name, _ in layout.files:
        if "/" in name or not name.isascii() or not fmt.valid_data_file_name(name, layout.save_id):
            raise fmt.CheckpointFormatError(
                f"{where}: data file {name!r} is not a plain file name of save {layout.save_id!r}; the tiers hold "
                f"checkpoints saved by TierManager (no data_dirs): this one was crafted or saved another way")
    return metadata, layout, extra


def _holding(root: files.Root) -> Holding:
    files_: dict[str, int] = {}
    for name, kind in root.entries():
        if kind == "other":
            raise _refused(root.join(name), _kind(root, name))  # before anything opens it
        if name.endswith(fmt.DATA_SUFFIX) and kind == "file":
            files_[name] = root.lstat(name).st_size
    save_id = meta_files = None
    try:
        _, layout, _ = decode(_metadata_of(root), root.join(fmt.METADATA_NAME))
        save_id, meta_files = layout.save_id, [(n, s) for n, s in layout.files]
    except (OSError, fmt.CheckpointFormatError):
        pass  # missing or damaged: counts as absent
    return Holding(save_id, meta_files, files_)


def scan(root: str) -> dict[int, Holding]:
    """Every owned step directory under ``root``: its metadata (decoded,
    checked) and its data files.  A damaged metadata counts as absent; a
    link where the metadata belongs, or a FIFO, socket or device anywhere in
    the directory, is a :class:`TierPathError` (nothing opened)."""
    out: dict[int, Holding] = {}
    for step, path in owned_steps(root):
        try:
            with opened(path) as d:
                out[step] = _holding(d)
        except FileNotFoundError:
            continue
    return out


def write_atomic(path: str, data: bytes | memoryview, sync: bool = True) -> None:
    """``data`` at ``path``, all or nothing: a temporary beside it (created
    new, no link followed), synced, renamed over it, the directory synced.
    The directory must be a real one (:class:`TierPathError` for a link)."""
    directory, name = os.path.split(path)
    with opened(directory) as d:
        try:
            d.replace_bytes(name, data, sync=sync, tmp_name=_tmp_name(name))
        except files.UnsafePathError:
            raise _refused(path, _kind(d, name)) from None


class RangesFile:
    """A new file of ``size`` bytes at ``path`` (an existing entry is an error),
    holes everywhere, written range by range; :meth:`close` when done,
    :meth:`discard` removes it.  Not synced: a restore's scratch."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        directory, name = os.path.split(path)
        with opened(directory) as d:
            self.fd: int | None = d.create_exclusive(name)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            self.discard()
            raise

    def write(self, ranges, data) -> None:
        """``data``: the bytes of ``ranges`` (``(offset, length)`` pairs),
        concatenated."""
        if self.fd is None:
            raise ValueError(f"{self.path}: closed")
        view = memoryview(data).cast("B")
        at = 0
        for off, n in ranges:
            if off < 0 or off + n > self.size:
                raise ValueError(f"{self.path}: range {off}+{n} outside the file's {self.size} bytes")
            w = 0
            while w < n:
                w += os.pwrite(self.fd, view[at + w: at + n], off + w)
            at += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def discard(self) -> None:
        self.close()
        unlink_in(self.path)


def retain(root: str, keep: int, pinned: set[int] | frozenset[int] = frozenset(),
           newest: int | None = None) -> list[str]:
    """Keep the ``keep`` newest owned steps under ``root`` that have metadata and
    remove older owned step directories, except ``pinned``; newer ones stay.
    ``newest``: steps after it do not count as committed.  Returns what was removed."""
    if keep < 1:
        raise ValueError(f"retention keeps at least 1 step, got {keep}")
    held = sorted(owned_steps(root))
    committed = [s for s, p in held if has_metadata(p) and (newest is None or s <= newest)]
    if len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    removed = []
    for step, path in held:
        if step < oldest_kept and step not in pinned and remove_owned(root, step):
            removed.append(path)
    return removed


def has_metadata(path: str) -> bool:
    try:
        with opened(path) as d:
            return stat.S_ISREG(d.lstat(fmt.METADATA_NAME).st_mode)
    except FileNotFoundError:
        return False


def _ours(name: str) -> bool:
    """A name fp_dcp gives a file of a step directory."""
    return name.isascii() and (
        name in (fmt.METADATA_NAME, fmt.LOCK_NAME) or name.endswith(TMP_SUFFIX)
        or (name.startswith(fmt.METADATA_NAME + ".") and name.endswith(".tmp"))
        or ("/" not in name and fmt.valid_data_file_name(name)))


def remove_owned(root: str, step: int | None, name: str | None = None) -> bool:
    """Remove the owned directory ``root/<name>`` (default: step ``step``'s):
    metadata first, then fp_dcp's files, the marker last, the directory when
    empty; nothing followed, an unmarked directory left alone.  Returns whether
    it is gone."""
    if name is None:
        assert step is not None  # a step or a name
        name = step_name(step)
    with opened(root, user=True) as r:
        try:
            with opened_sub(r, name) as d:
                if not owned(d, step):
                    return False
                d.unlink(fmt.METADATA_NAME)
        except FileNotFoundError:
            return True
        except TierPathError:
            return False  # a link or a file there: not the tiers'
        left = r.remove_owned(name, lambda rel, kind: kind == "file" and rel != MARKER_NAME and _ours(rel))
        if left != [MARKER_NAME]:
            return not left  # something that is not the tiers' is in it: the marker keeps it known
        r.unlink(os.path.join(name, MARKER_NAME))
        try:
            r.rmdir(name)
        except OSError:
            return False
    return True


def unlink_in(path: str) -> None:
    """Remove the file ``path`` (a link itself, never its target) from a
    directory that is no link; gone already is fine."""
    directory, name = os.path.split(path)
    try:
        with opened(directory) as d:
            d.unlink(name)
    except FileNotFoundError:  # the directory went first (a restore's leader removes its own)
        pass
