"""Keep the cyclic garbage collector off a save's or a load's long-lived objects.

A state dict of thousands of tensors makes every full collection of the
cyclic GC walk all of them (and the ~250,000 objects of an imported torch);
DCP's planning, the writer's ``finish`` and the reader's metadata and jobs
allocate enough to trigger several per save or load (measured: 0.5 s of a
2.2 s save of 9,245 tensors; four full collections, ~0.15 s each, in a load
of 9,000 tensors).  ``gc.freeze()`` moves the objects that exist when the
save or load starts out of the collector's sight for its duration only; what
it allocates is still collected.

The writer freezes in ``set_up_storage_writer`` and thaws at the end of its
rank's part of the save (``write_data``, or ``finish`` on the coordinator);
the reader decodes the metadata with the collector paused (:func:`paused`),
freezes in ``set_up_storage_reader`` and thaws at the end of ``read_data``.
Both thaw in ``reset()`` and ``close()`` if a save or load failed in between
(their own steps thaw on their own errors, :meth:`GcFreeze.thaw_on_error`; a
failure inside DCP between them, another rank's error raised here, leaves it
frozen until the next save or load, ``close()`` or collection: the frozen
objects are the long-lived ones of the job).
"""

from __future__ import annotations

import contextlib
import gc
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


class GcFreeze:
    """One save's or load's ``gc.freeze()``, undone once by :meth:`thaw` (or when
    this object is collected), and only if nobody else froze since."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> None:
        """Freeze, unless this save already did or something else froze
        objects (``gc.get_freeze_count()``): those stay as they are."""
        if not self.frozen and gc.get_freeze_count() == 0:
            gc.freeze()
            self.frozen = True
            # made after the freeze: it stays out of the permanent generation
            # unless something else calls gc.freeze() before the thaw
            self._sentinel: list = []
            self._finalizer = weakref.finalize(self, _thaw_if_ours, self._sentinel)

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
    """``gc.unfreeze()``, unless something else froze objects since the save
    (or load) did: ``sentinel`` was made right after its ``gc.freeze()``, so it is
    still among the collector's generations (``gc.get_objects()``, which holds
    only what was made since the freeze and is small) unless another
    ``gc.freeze()`` moved it to the permanent generation.  Then the
    application froze objects of its own, which a global unfreeze would undo,
    and everything stays frozen (still freed by reference counting; only
    cycles among the frozen objects wait)."""
    if any(o is sentinel for o in gc.get_objects()):
        gc.unfreeze()
