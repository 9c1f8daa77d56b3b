"""Which save is running, and how it ended: :func:`wrap_hooks` routes the
writer's protocol calls to the :class:`Track` of their thread's
:class:`Save` (or a checkpoint process's :class:`Reporter`); the next save
waits for the last and raises its failure once."""

# dcp.async_save stages on the training thread and saves in the background,
# but tells the stager neither which thread runs the save nor how it ends:
# the writer's hook methods do.  A Save is done when the writer is done with
# it (coordinator: finish returned; other ranks: write_data completed), when
# it failed, or when the thread running it ended.

from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any, Callable, Iterable

from fp_dcp.staging.arena import FAILED, OK, RUNNING, attach, write_status

__all__ = ["HOOKS", "wrap_hooks", "PreviousSaveFailed", "Save", "Track", "Reporter", "attribute"]

# Writer methods whose calls tell which save is running, and how it ends.
HOOKS = ("set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish")

# Save.wait on a save no thread has picked up yet: how often it looks again,
# and every how many looks it collects garbage (a staged dict held only by a
# reference cycle — a traceback — is otherwise never seen to be dropped).
_POLL_SECONDS = 0.05
_POLLS_PER_GC = 20
# ... and on the thread running it: how often it checks that thread is alive.
_JOIN_SECONDS = 0.1


# ------------------------------------------------------------ the wrapping

# find_track(writer, method name, args, kwargs) -> Track, Reporter or None
FindTrack = Callable[[Any, str, tuple, dict], Any]


def wrap_hooks(cls: type, find_track: FindTrack) -> None:
    """Wrap the :data:`HOOKS` that ``cls`` defines itself (once): each call
    asks ``find_track`` where to report, and reports its failure, the end of
    ``write_data`` (when its future completes) and ``finish``."""
    for name in HOOKS:
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "_fp_tracked", False):
            setattr(cls, name, _tracked(name, fn, find_track))


def _tracked(name: str, fn: Callable, find_track: FindTrack) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        track = find_track(self, name, args, kwargs)
        if track is None:
            return fn(self, *args, **kwargs)
        try:
            out = fn(self, *args, **kwargs)
        except BaseException as e:
            track.failed(e)
            raise
        if name == "write_data" and hasattr(out, "add_done_callback"):
            def done(f: Any) -> None:
                try:
                    f.value()
                except BaseException as e:  # noqa: BLE001 - recorded, DCP raises it
                    track.failed(e)
                else:
                    track.written()

            out.add_done_callback(done)
        elif name == "write_data":
            track.written()
        elif name == "finish":
            track.finished()
        return out

    wrapper._fp_tracked = True  # type: ignore[attr-defined]
    return wrapper


def _set_up_args(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """(is_coordinator, use_collectives) of a ``set_up_storage_writer`` call."""
    return bool(args[0] if args else kwargs.get("is_coordinator", True)), bool(kwargs.get("use_collectives", True))


# ------------------------------------------------------------ one save's record


class PreviousSaveFailed(RuntimeError):
    """A save not started because the one before it on the writer failed."""


class Save:
    """One staged save on this rank: from ``stage`` until the writer is done
    with it (coordinator: ``finish`` returned; other ranks: ``write_data``
    completed), it failed, or the thread running it ended."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.reported = False
        self.thread: threading.Thread | None = None
        self.coordinator = True
        self.collectives = True
        self.staged = False  # staging finished (the save may start)
        self.process = False  # pickled for a checkpoint process
        self.reporting = False  # ... whose writer reports through the arena header
        self.arena: Any = None  # the staging.arena.Arena it was staged into
        self.refs: list[weakref.ref] = []  # the staged dict / lazy future
        self.snapshot: weakref.ref | None = None
        self.via_async_save = False  # a DCP save will pick the staged dict up
        self.copy_threads = 1  # memcpy threads of its staging

    def finish(self, error: BaseException | None = None, *, reported: bool = False) -> None:
        if not self.done.is_set():
            self.error = error
            self.reported = reported or error is None
            self.done.set()

    def _orphaned(self) -> bool:
        """Staged, never picked up by a save, and nobody holds it any more
        (an ``async_save`` that failed after staging, a dropped ``stage()``)."""
        return self.thread is None and self.staged and all(r() is None for r in self.refs)

    def wait(self) -> None:
        me = threading.current_thread()
        polls = 0
        while not self.done.is_set():
            t = self.thread
            if t is None:
                if self._orphaned():
                    self.finish(None)
                elif not self.done.wait(_POLL_SECONDS):
                    polls += 1
                    if polls % _POLLS_PER_GC == 0:
                        gc.collect()  # a staged dict held only by a reference cycle (a traceback)
                continue
            if t is not me:
                t.join(_JOIN_SECONDS)
                if t.is_alive():
                    continue
            # The thread that ran the save has ended (or is this one: a save
            # run synchronously after stage()) without the writer finishing.
            self._ended()

    def _ended(self) -> None:
        if self.process and not self.reporting:
            self.finish(None)  # no way to learn how it went here: the future tells
            return
        if self.process and self.arena is not None:
            state, msg = self.arena.read_status(self.seq)
            if state == OK:
                self.finish(None)
                return
            if state == FAILED:
                self.finish(RuntimeError(f"the checkpoint process failed: {msg}"))
                return
        self.finish(
            RuntimeError(
                "the save did not complete on this rank (see the future that dcp.async_save returned)"
            )
        )


class Track:
    """Hook calls of the writer, attributed to one :class:`Save`."""

    def __init__(self, rec: Save, name: str, args: tuple, kwargs: dict) -> None:
        self.rec = rec
        if name == "set_up_storage_writer":
            rec.coordinator, rec.collectives = _set_up_args(args, kwargs)

    def failed(self, e: BaseException) -> None:
        self.rec.finish(e)

    def written(self) -> None:
        if not self.rec.coordinator and self.rec.collectives:
            self.rec.finish(None)  # this rank's writer is not used again

    def finished(self) -> None:
        self.rec.finish(None)


def attribute(saves: Iterable[Save], name: str, args: tuple, kwargs: dict) -> Track | None:
    """The :class:`Track` of a hook call on this thread (its save, or a staged
    save not yet picked up), or None.  The caller holds the lock on ``saves``."""
    me = threading.current_thread()
    saves = list(saves)
    for rec in saves:
        if not rec.done.is_set() and rec.thread is me:
            return Track(rec, name, args, kwargs)
    if name != "set_up_storage_writer":
        return None
    for rec in saves:
        if not rec.done.is_set() and rec.thread is None and rec.staged:
            rec.thread = me
            return Track(rec, name, args, kwargs)
    return None


class Reporter:
    """The same hooks in the checkpoint process: the outcome goes to the header
    page of the arena the staged state dict came in (``handle``: the arena's
    handle, the save's sequence number, and a dict shared by the calls of
    that save)."""

    def __init__(self, handle: tuple, name: str, args: tuple, kwargs: dict) -> None:
        self.handle = handle
        self.coordinator = True
        self.collectives = True
        if name == "set_up_storage_writer":
            handle[-1]["coordinator"], handle[-1]["collectives"] = _set_up_args(args, kwargs)
            self._post(RUNNING)
        self.coordinator = handle[-1].get("coordinator", True)
        self.collectives = handle[-1].get("collectives", True)

    def _post(self, state: int, msg: str = "") -> None:
        pid, fd, token, size, seq, _ = self.handle
        try:
            buf = attach(pid, fd, token, size)
            write_status(buf, seq, state, msg)
        except OSError:
            pass  # the trainer went away; nobody to tell

    def failed(self, e: BaseException) -> None:
        self._post(FAILED, f"{type(e).__name__}: {e}")

    def written(self) -> None:
        if not self.coordinator and self.collectives:
            self._post(OK)

    def finished(self) -> None:
        self._post(OK)
