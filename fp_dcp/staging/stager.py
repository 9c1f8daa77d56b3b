"""``FastPersistWriter`` as DCP's ``AsyncStager``: the mixin, the lazy future
and :class:`Stager`, which runs one staging and keeps the saves in flight.
What staging does for a caller is docs/STAGING.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import os
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from fp_dcp import _dcp_hooks, _native
from fp_dcp import format as fmt
from fp_dcp.engine import IOSession, PinnedBuffer
from fp_dcp.gc_freeze import paused
from fp_dcp.staging import crc_registry
from fp_dcp.staging.arena import PAGE, PENDING, Arena, Spill, write_status
from fp_dcp.staging.copier import Copier, eager_copy_threads
from fp_dcp.staging.layout import SPILL, Layout, build, meta, plan, views, walk
from fp_dcp.staging.snapshot import Snapshot, StagedStateDict
from fp_dcp.staging.tracking import PreviousSaveFailed, Reporter, Save, Track, attribute, wrap_hooks

__all__ = ["AsyncStagingMixin", "Stager"]


# ----------------------------------------------------------------- the mixin


class AsyncStagingMixin:
    """The ``AsyncStager`` side of :class:`~fp_dcp.FastPersistWriter`
    (docs/STAGING.md); the host provides ``options``, ``path``, ``reset()`` and
    calls :meth:`_close_staging` from ``close()``."""

    # AsyncStager protocol: staging is complete when stage() returns (eager) or
    # its future resolves (lazy); async_save never needs synchronize_staging().
    _synchronize_after_execute: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        wrap_hooks(cls, _track_of)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | concurrent.futures.Future:
        """Copy ``state_dict`` into the arena: the staged copy (eager) or a
        future of it (lazy).  Called by ``dcp.async_save``."""
        return self._stager().stage(self, state_dict)

    def synchronize_staging(self) -> None:
        """Wait until the last lazy staging is complete (a no-op for eager
        staging).  ``AsyncSaveResponse.staging_completion`` is the better way."""
        st = self.__dict__.get("_fp_staging")
        if st is not None:
            st.synchronize()

    @property
    def staging_stats(self) -> dict[str, Any]:
        """What the last staging did: seconds, bytes, arena size, spilled
        bytes, whether the arena was (re)allocated, shared, page-locked."""
        st = self.__dict__.get("_fp_staging")
        return dict(st.last_stats) if st is not None else {}

    def _stager(self) -> "Stager":
        st = self.__dict__.get("_fp_staging")
        if st is None:
            st = self.__dict__["_fp_staging"] = Stager()
        return st

    def _close_staging(self) -> None:
        """Wait for the save in flight, then free the arena, ring and spill file."""
        st = self.__dict__.pop("_fp_staging", None)
        if st is not None:
            st.close()

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer with each request.  Its engine, lock
        # and staging state stay here; the copy reports through the arena.
        state = self.__dict__.copy()
        st = state.pop("_fp_staging", None)
        state.pop("_fp_report", None)
        for name, value in state.items():
            if _is_resource(value):
                state[name] = None
            elif isinstance(value, dict) and any(_is_resource(v) for v in value.values()):
                state[name] = {}
        if st is not None:
            state["_fp_report"] = st.report_handle()
        return state


def _is_resource(value: Any) -> bool:
    """Engines, sessions and buffers: they stay with the process that made them."""
    return isinstance(value, (IOSession, PinnedBuffer, _native.AlignedBuffer, _native.Engine))


def _track_of(writer: Any, name: str, args: tuple, kwargs: dict) -> Track | Reporter | None:
    """Where a hook call of ``writer`` reports (see :mod:`fp_dcp.staging.tracking`):
    the save it belongs to in this process, the arena header of the trainer
    in a checkpoint process, or nowhere (a save that was not staged)."""
    st = writer.__dict__.get("_fp_staging")
    if st is not None:
        return st.track(name, args, kwargs)
    report = writer.__dict__.get("_fp_report")
    return Reporter(report, name, args, kwargs) if report is not None else None


# ------------------------------------------------------------ the lazy future


class _StagingFuture(concurrent.futures.Future):
    """The future lazy ``stage`` returns: a *failed* one reports ``done()`` False
    until a callback is attached (hook 4 of docs/ARCHITECTURE.md)."""

    _watched = False

    def done(self) -> bool:
        finished = super().done()
        if finished and not self._watched and super().exception(timeout=0) is not None:
            return False
        return finished

    def add_done_callback(self, fn: Callable) -> None:
        self._watched = True
        super().add_done_callback(fn)


# ------------------------------------------------------------------ the stager


class Stager:
    """A writer's staging state: arena, layout, saves in flight."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.arena: Arena | None = None
        self.spill: Spill | None = None
        self.layout: Layout | None = None
        self.views: list[torch.Tensor | None] | None = None  # resident views of (arena, layout)
        self.shared = False  # stage into shared memory (PROCESS mode seen, or asked for)
        self.seq = 0
        self.saves: collections.deque[Save] = collections.deque()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.copier = Copier()
        self.last_future: weakref.ref | None = None
        self.last_stats: dict[str, Any] = {}
        self.closed = False
        self.before_copy: Callable[[], None] | None = None  # test hook: runs just before the copy
        self.checkpoint_hint: str | None = None

    # ---------------------------------------------------------------- stage

    def stage(self, writer: Any, state_dict: dict[str, Any]) -> Any:
        options = writer.options
        mode = options.staging
        if self.closed:
            raise RuntimeError("FastPersistWriter is closed")
        if not isinstance(state_dict, dict):
            raise TypeError(f"stage() takes a state dict, not {type(state_dict).__name__}")
        via_async_save, self.checkpoint_hint = _dcp_hooks.async_save_caller()
        leaves: list[torch.Tensor] = []
        values: list[Any] = []
        # On the training's thread: what the save is of, as it is now (an
        # alias per tensor, the containers' shape, copies of the other
        # values), and where each CUDA stream is.  Thousands of objects and no
        # garbage: no collection walks the process's heap meanwhile.
        with paused():
            skeleton = walk(state_dict, leaves, values)
            values = copy.deepcopy(values)
            events = self.copier.cuda_events(leaves)
        with self.lock:
            prev = self.saves[-1] if self.saves else None
            self.seq += 1
            rec = Save(self.seq)
            rec.via_async_save = via_async_save
            self.saves.append(rec)
            while self.saves and self.saves[0].done.is_set() and self.saves[0] is not prev:
                self.saves.popleft()
        if mode == "eager":
            # The training waits for an eager copy: use the cores it would use.
            rec.copy_threads = eager_copy_threads()
            try:
                self._wait(prev)
                staged = self._stage_now(writer, rec, skeleton, leaves, values, events)
            except BaseException as e:
                rec.finish(e, reported=True)  # raised here: nothing to report later
                raise
            return staged
        # A lazy copy overlaps the forward/backward pass: one thread (the
        # default), leaving the other cores to the training.
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-stage")
        fut = _StagingFuture()
        rec.refs.append(weakref.ref(fut))
        self.last_future = weakref.ref(fut)
        self.pool.submit(self._stage_later, writer, rec, prev, fut, skeleton, leaves, values, events)
        return fut

    def _stage_later(self, writer, rec, prev, fut, skeleton, leaves, values, events) -> None:
        try:
            self._wait(prev)
            staged = self._stage_now(writer, rec, skeleton, leaves, values, events)
        except PreviousSaveFailed as e:
            rec.finish(e, reported=True)
            fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - handed to the future
            rec.finish(e)
            fut.set_exception(e)
        else:
            fut.set_result(staged)

    def _wait(self, prev: Save | None) -> None:
        """Wait until the previous save on this writer is done; raise its
        failure once."""
        if prev is None:
            return
        prev.wait()
        if prev.error is not None and not prev.reported:
            prev.reported = True
            raise PreviousSaveFailed(
                f"the previous async save on this FastPersistWriter failed, so this one was not "
                f"started: {type(prev.error).__name__}: {prev.error}"
            ) from prev.error

    def _stage_now(self, writer, rec: Save, skeleton, leaves, values, events) -> dict:
        t0 = time.perf_counter()
        options = writer.options
        metas = tuple(meta(t) for t in leaves)  # (a lazy save's, on its thread: the aliases do not change)
        # Each save gets a fresh save_id even when async_save passes no
        # checkpoint_id (DCP then does not call reset()).
        writer.reset()
        alignment = max(PAGE, options.alignment_bytes or 0)
        with self.lock:
            if self.closed:
                raise RuntimeError("FastPersistWriter is closed")
            if options.staging_shared_memory:
                self.shared = True
            layout = self.layout
            if layout is None or layout.metas != metas or self._options_key(options) != self._layout_key:
                layout = plan(metas, options, alignment)
                self._layout_key = self._options_key(options)
            grown = self._ensure_arena(layout, alignment, options)
            arena = self.arena
            assert arena is not None  # made by _ensure_arena
            if any(m[2].type == "cuda" for m in metas):
                arena.register_cuda()
            if self.layout is not layout or self.views is None:
                self.views = None
                self.layout = layout
                self.views = views(arena.buf, None, layout)
            write_status(arena.buf, rec.seq, PENDING)
            rec.arena = arena
        crc_registry.forget_staged_checksums([arena.address])
        if self.before_copy is not None:
            self.before_copy()
        spill_handle = None
        spill_map = None
        tensors = self.views
        assert tensors is not None
        block = fmt.CHECKSUM_BLOCK_BYTES if options.write_checksums and options.staging_checksums else 0
        if layout.spill_bytes:
            spill = self._spill_file(writer, options)
            crcs = self.copier.copy(arena.buf, layout, tensors, leaves, events, spill, rec.copy_threads, block)
            spill_map = spill.mapping()
            spill_handle = spill.handle()
            tensors = [v if w != SPILL else t for v, w, t in zip(tensors, layout.where, views(None, spill_map, layout))]
        else:
            crcs = self.copier.copy(arena.buf, layout, tensors, leaves, events, None, rec.copy_threads, block)
        crc_registry.remember(arena.buf, arena.address, arena.size, crcs)
        staged = build(skeleton, tensors, values, root=StagedStateDict)
        staged._fp_snapshot = Snapshot(
            self, rec, arena, layout, skeleton, values, spill_handle, options.staging_shared_memory, crcs
        )
        rec.refs.append(weakref.ref(staged))
        rec.snapshot = weakref.ref(staged._fp_snapshot)
        rec.staged = True
        seconds = time.perf_counter() - t0
        self.last_stats = {
            "seconds": seconds,
            "bytes": layout.payload_bytes,
            "gbps": layout.payload_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "arena_bytes": arena.size,
            "arena_allocated": grown,
            "arena_shared": arena.shared,
            "arena_locked": arena.locked,
            "spilled_bytes": layout.spilled_bytes,
            "tensors": len(leaves),
        }
        return staged

    @staticmethod
    def _options_key(options: Any) -> tuple:
        """The options a layout depends on."""
        return (
            options.staging_memory_limit_bytes,
            options.pack_threshold_bytes,
            options.pack_alignment_bytes,
            options.alignment_bytes,
            options.cuda_chunk_bytes,
        )

    _layout_key: tuple | None = None

    def _ensure_arena(self, layout: Layout, alignment: int, options: Any) -> bool:
        """An arena for ``layout`` (the one there if it fits); whether it is new."""
        a = self.arena
        if a is not None and a.size >= layout.arena_bytes and a.shared == self.shared:
            cap = options.staging_memory_limit_bytes
            if cap is None or a.size <= cap:
                return False
        self.views = None
        if a is not None:
            _close_arena(a)
            self.arena = None
        self.arena = Arena(layout.arena_bytes, alignment, self.shared)
        return True

    def _spill_file(self, writer: Any, options: Any) -> Spill:
        directory = options.staging_spill_dir or self.checkpoint_hint or writer.path
        if directory is None:
            raise ValueError(
                "the state dict exceeds FastPersistOptions.staging_memory_limit_bytes and the writer "
                "has no directory to spill into: set staging_spill_dir or FastPersistWriter(path)"
            )
        s = self.spill
        if s is not None and s.directory != directory:
            # A new checkpoint directory each save: keep the spill file (and
            # its engine) while the new one is on the same file system.
            os.makedirs(directory, exist_ok=True)
            if os.stat(directory).st_dev != s.dev:
                s.close()
                self.spill = s = None
        if s is None:
            self.spill = s = Spill(directory, options)
        s.drop_cache()
        return s

    # ---------------------------------------------------------- PROCESS mode

    def share(self, snap: Snapshot) -> Arena:
        """The arena a pickled snapshot refers to, moved to shared memory on
        first use (auto mode); later saves stage into shared memory directly."""
        with self.lock:
            arena = snap.arena
            if arena.closed:
                raise RuntimeError(
                    "the FastPersistWriter was closed before the checkpoint process received the "
                    "staged state dict; wait for the async_save future before close()"
                )
            if arena.shared:
                return arena
            shared = Arena(arena.size, PAGE, True)
            if arena.cuda_registered:
                shared.register_cuda()
            _native.copy_gather(shared.buf, np.zeros(1, np.int64), [arena.buf])
            self.shared = True
            if self.arena is arena:
                self.views = None
                self.layout = None
                self.arena = shared
                _close_arena(arena)
            snap.arena = shared
            snap.rec.arena = shared
            crc_registry.remember(shared.buf, shared.address, shared.size, snap.crcs)
            return shared

    def report_handle(self) -> tuple | None:
        """Where the pickled writer copy reports the outcome of the save being
        pickled (the newest one)."""
        with self.lock:
            for rec in reversed(self.saves):
                if not rec.staged or rec.done.is_set():
                    continue
                snap = rec.snapshot() if rec.snapshot is not None else None
                if snap is None or snap.shared_option is False:
                    return None
                rec.process = True
                if rec.thread is None:
                    rec.thread = threading.current_thread()
                arena = self.share(snap)
                rec.reporting = True
                return (*arena.handle(), rec.seq, {})
        return None

    # --------------------------------------------------------- hooks, waits

    def track(self, name: str, args: tuple, kwargs: dict) -> Track | None:
        """Where a hook call of the writer on this thread reports."""
        with self.lock:
            return attribute(self.saves, name, args, kwargs)

    def synchronize(self) -> None:
        ref = self.last_future
        fut = ref() if ref is not None else None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # lazy staging in progress
        for rec in list(self.saves):
            # Saves that started, or that async_save handed to its executor; a
            # dict from a direct stage() call that no save picked up keeps its views.
            if rec.thread is not None or rec.via_async_save:
                rec.wait()
        self.copier.shutdown()
        with self.lock:
            self.saves.clear()
            self.views = None
            self.layout = None
            if self.arena is not None:
                _close_arena(self.arena)
                self.arena = None
            if self.spill is not None:
                self.spill.close()
                self.spill = None


def _close_arena(arena: Arena) -> None:
    """Close an arena, dropping the staging checksums kept for it first."""
    crc_registry.forget_staged_checksums([arena.address])
    arena.close()
