"""Draining a committed local step to the persistent tier: each rank copies its
files (checked), then rank 0 commits as the writer does, only if every rank
succeeded; a failed drain removes its copies and is retried."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Callable

from fp_dcp import format as fmt
from fp_dcp import wire
from fp_dcp.options import FastPersistOptions
from fp_dcp.tiers import integrity, store
from fp_dcp.tiers.replicate import FileIO, file_io_for

__all__ = ["DrainResult", "DrainIO", "drain_step", "files_of_rank"]

# Test hook: called with the name of each point of the protocol a drain
# passes ("start <step>", "copied <file>", "before-commit", "committed"); tests that kill a
# drain there set it in the child process.
fault_hook: Callable[[str], None] | None = None

_RANK = re.compile(r"\.r(\d{1,9})\.")


def files_of_rank(layout: fmt.StorageLayout, rank: int) -> list[int]:
    """The ids of the data files that ``rank`` wrote (the writer's names say it)."""
    out = []
    for fid, (name, _) in enumerate(layout.files):
        m = _RANK.search(name)
        if m is not None and int(m.group(1)) == rank:
            out.append(fid)
    return out


@dataclasses.dataclass
class DrainResult:
    step: int
    ok: bool
    bytes: int = 0  # this rank's
    seconds: float = 0.0
    error: str | None = None  # the first failure of any rank
    skipped: bool = False  # already committed there


class DrainIO:
    """A drain thread's checked O_DIRECT copies of data files to the persistent
    tier (buffers kept between drains).  One thread at a time; :meth:`close`
    frees the buffers."""

    def __init__(self, options: FastPersistOptions) -> None:
        self.options = options
        self._src: FileIO | None = None
        self._dst: FileIO | None = None

    def copy(self, src: str, dst: str, layout: fmt.StorageLayout, fid: int, sync: bool) -> int:
        """Copy data file ``fid`` of ``layout`` from ``src`` to ``dst``;
        returns its bytes.  :class:`~fp_dcp.tiers.integrity.IntegrityError`
        when ``src`` is missing, short or fails a checksum (nothing named)."""
        size = layout.files[fid][1]
        self._src = file_io_for(self._src, self.options, os.path.dirname(src))
        try:
            data = self._src.read(src, size)
        except FileNotFoundError:
            raise integrity.IntegrityError(src, "missing") from None
        except OSError as e:
            raise integrity.IntegrityError(src, e.strerror or str(e)) from None
        integrity.check_buffer(data, layout, fid, src)
        self._dst = file_io_for(self._dst, self.options, os.path.dirname(dst))
        self._dst.write_named(dst, data, sync)
        return size

    def close(self) -> None:
        for io in (self._src, self._dst):
            if io is not None:
                io.close()
        self._src = self._dst = None


def _point(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def drain_step(step: int, local_dir: str, persistent_root: str, rank: int, group,
               keep: int | None = None, sync: bool = True, io: DrainIO | None = None) -> DrainResult:
    """Drain ``local_dir`` (a committed step of this node's local tier) to
    the persistent root; every rank of ``group`` calls it for the same step.
    ``io``: the copier to use (kept by the caller between drains; default:
    one for this drain, with the options of the environment)."""
    if io is None:
        io = DrainIO(FastPersistOptions.from_env())
        try:
            return drain_step(step, local_dir, persistent_root, rank, group, keep, sync, io)
        finally:
            io.close()
    t0 = time.perf_counter()
    dest = store.step_dir(persistent_root, step)
    done = claimed = False
    copied = 0
    error = blob = layout = None
    try:  # any failure here is this rank's outcome: the others must still meet it below
        _point(f"start {step}")
        blob = store.read_metadata(local_dir)
        _, layout, _ = store.decode(blob, os.path.join(local_dir, fmt.METADATA_NAME))
        store.claim_step(persistent_root, step)  # a link or a folder the tiers did not make there: refused
        claimed = True
        done = _committed_save_id(dest) == layout.save_id
        if not done:
            for fid in files_of_rank(layout, rank):
                name, _ = layout.files[fid]
                copied += io.copy(os.path.join(local_dir, name), os.path.join(dest, name), layout, fid, sync)
                _point(f"copied {name}")
            if sync:
                with store.opened(dest) as d:
                    d.sync()
    except Exception as e:  # noqa: BLE001 - every rank learns it below
        error = f"rank {rank}: {e}"
    outcomes = wire.gather((error, done), (wire.maybe(str), bool), group, what=f"drain of step {step}: outcomes")
    first = next((e for e, _ in outcomes if e is not None), None)
    done = first is None and all(d for _, d in outcomes)
    if not done:
        if first is None and rank == 0:
            try:
                _point("before-commit")
                assert blob is not None and layout is not None  # no rank failed: this one read both
                store.write_atomic(os.path.join(dest, fmt.METADATA_NAME), blob, sync=sync)  # the commit
                _point("committed")
                _tidy(persistent_root, dest, step, layout, keep)
            except Exception as e:  # noqa: BLE001
                first = f"rank 0: committing {dest}: {e}"
        elif first is not None and claimed:
            try:
                assert layout is not None  # claimed after the layout was read
                _remove_uncommitted(dest, layout, rank)
            except Exception as e:  # noqa: BLE001 - every rank still meets the broadcast below
                first = f"{first}; rank {rank}: removing what it copied: {e}"
        first, _ = wire.broadcast(first, wire.maybe(str), 0, group, what=f"drain of step {step}: the commit")
    return DrainResult(step, first is None, copied, time.perf_counter() - t0, first, skipped=done)


def _committed_save_id(directory: str) -> str | None:
    try:
        _, layout, _ = store.decode(store.read_metadata(directory), directory)
        return layout.save_id
    except (OSError, fmt.CheckpointFormatError):
        return None


def _remove_uncommitted(dest: str, layout: fmt.StorageLayout, rank: int) -> None:
    """A failed drain: each rank removes the files it copied, unless a
    committed metadata there names them."""
    if _committed_save_id(dest) == layout.save_id:
        return
    mine = {name for name, _ in (layout.files[fid] for fid in files_of_rank(layout, rank))}
    with store.opened(dest) as d:
        for entry, kind in d.entries():
            base = entry.split(".", 3)[:3]  # <save_id>.r<rank>.<k>, of a data file or of its temporaries
            if kind == "file" and (entry in mine or (entry.endswith(store.TMP_SUFFIX)
                                                     and ".".join(base) + fmt.DATA_SUFFIX in mine)):
                d.unlink(entry)


def _tidy(root: str, dest: str, step: int, layout: fmt.StorageLayout, keep: int | None) -> None:
    """After a commit: stale files of ``dest``, uncommitted older steps, and
    committed ones beyond ``keep``; only what the tiers own."""
    names = {name for name, _ in layout.files}
    with store.opened(dest) as d:
        for name, kind in d.entries():
            stale = (name.endswith(fmt.DATA_SUFFIX) and name not in names) or name.endswith(store.TMP_SUFFIX)
            if stale and kind == "file":
                d.unlink(name)
    for s, path in store.owned_steps(root):
        if s < step and not store.has_metadata(path):
            store.remove_owned(root, s)
    if keep is not None:
        store.retain(root, keep)
