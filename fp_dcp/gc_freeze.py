"""Keep the cyclic GC off a save's or a load's long-lived objects: ``gc.freeze()``
from the writer's / reader's set-up to the end of its rank's part (and in
``reset()`` / ``close()``).  Does nothing where the interpreter keeps objects
of its own frozen (CPython 3.12 crashed after a freeze and thaw) or the
application froze objects itself."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import weakref
from typing import Iterator

__all__ = ["GcFreeze", "paused"]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for a block that allocates many objects and frees
    none (a decoder building the metadata's objects), back as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_start_count: int | None = None
_start_lock = threading.Lock()


_ZERO_AT_START = ((3, 10), (3, 11), (3, 13))  # versions whose bare interpreter starts with none frozen


def interpreter_start_count() -> int:
    """``gc.get_freeze_count()`` of a bare interpreter of this Python (read
    once, in a child process, where not known)."""
    global _start_count
    with _start_lock:
        if _start_count is None and sys.version_info[:2] in _ZERO_AT_START:
            _start_count = 0
        if _start_count is None:
            try:
                out = subprocess.run(
                    [sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
                    capture_output=True, text=True, timeout=30, check=True, stdin=subprocess.DEVNULL,
                )
                _start_count = int(out.stdout.strip())
            except (OSError, subprocess.SubprocessError, ValueError):
                _start_count = -1  # unknown: do not freeze
        return _start_count


def may_freeze() -> bool:
    """Nothing is frozen, and this interpreter keeps nothing of its own in
    the permanent generation (module documentation)."""
    return gc.get_freeze_count() == 0 and interpreter_start_count() == 0


class GcFreeze:
    """One save's or load's ``gc.freeze()``, undone once by :meth:`thaw` (or when
    this object is collected), and only if nobody else froze since."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> None:
        """Freeze, unless this save already did, something else froze
        objects (``gc.get_freeze_count()``: those stay as they are), or the
        interpreter keeps objects there itself (module documentation)."""
        if not self.frozen and may_freeze():
            gc.freeze()
            self.frozen = True
            self._track()

    def _track(self) -> None:
        """Right after our freeze: a sentinel that stays out of the
        permanent generation unless something else calls gc.freeze() before
        the thaw."""
        self._sentinel: list = []
        self._finalizer = weakref.finalize(self, _thaw_if_ours, self._sentinel)

    def refreeze(self) -> None:
        """Freeze, too, what was made since :meth:`freeze` (a save's plans and
        items, alive to its end), if this object froze and nothing froze
        since; :meth:`thaw` then undoes both."""
        if self.frozen and _ours(self._sentinel):
            gc.freeze()
            self._finalizer.detach()
            self._track()

    def thaw(self) -> None:
        if self.frozen:
            self.frozen = False
            self._finalizer.detach()
            _thaw_if_ours(self._sentinel)

    @contextlib.contextmanager
    def thaw_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.thaw()
            raise


def _thaw_if_ours(sentinel: list) -> None:
    """``gc.unfreeze()``, unless something else froze objects since (``sentinel``,
    made right after our freeze, is then no longer among the generations): the
    application's freeze is not undone, and everything stays frozen."""
    if _ours(sentinel):
        gc.unfreeze()


def _ours(sentinel: list) -> bool:
    """Whether the permanent generation holds only what we froze (made
    right after our last freeze, ``sentinel`` is not in it)."""
    return any(o is sentinel for o in gc.get_objects())
