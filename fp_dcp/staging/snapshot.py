"""The staged state dict, and how it travels to a checkpoint process: a
:class:`StagedStateDict` pickles as one handle to the shared arena, the
layout and the non-tensor values, and is rebuilt there as views into the
trainer's arena (:func:`rebuild`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, SupportsIndex

import numpy as np

from fp_dcp.staging import crc_registry
from fp_dcp.staging.arena import Arena, attach, attach_spill, buffer_address
from fp_dcp.staging.layout import Layout, build, views
from fp_dcp.staging.tracking import Save

__all__ = ["StagedStateDict", "Snapshot", "rebuild"]


class StagedStateDict(dict):
    """The staged state dict: a plain dict to DCP; pickles (PROCESS mode) as
    one handle to the arena instead of one shared segment per tensor."""

    _fp_snapshot: "Snapshot | None" = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        snap = self._fp_snapshot
        if snap is None:
            return (dict, (dict(self),))
        return snap.reduce(self)


@dataclasses.dataclass
class Snapshot:
    """What a staged state dict was staged from and into."""

    stager: Any  # the staging.stager.Stager: moves the arena to shared memory (share())
    rec: Save
    arena: Arena
    layout: Layout
    skeleton: tuple
    values: list[Any]
    spill: tuple | None  # handle of the spill file when tensors were spilled
    shared_option: bool | None
    crcs: dict[int, tuple[int, np.ndarray]]  # the staging copy's checksums, by arena offset

    def reduce(self, staged: dict) -> Any:
        self.rec.process = True
        if self.rec.thread is None:
            self.rec.thread = threading.current_thread()
        if self.shared_option is False:
            # torch pickles each tensor by moving its storage to a shared
            # segment: hand it fresh views, not the ones cached for reuse.
            fresh = views(self.arena.buf, attach_spill(*self.spill) if self.spill else None, self.layout)
            return (dict, (dict(build(self.skeleton, fresh, self.values)),))
        arena = self.stager.share(self)
        return (rebuild, (arena.handle(), self.spill, self.layout, self.skeleton, self.values, self.crcs))


def rebuild(arena: tuple, spill: tuple | None, layout: Layout, skeleton: tuple, values: list[Any],
            crcs: dict[int, tuple[int, np.ndarray]] | None = None) -> dict:
    """Unpickling in the checkpoint process: views into the trainer's arena
    (and the staging copy's checksums, for this process's writer)."""
    buf = attach(*arena)
    crc_registry.remember(buf, buffer_address(buf), arena[3], crcs or {})
    smap = attach_spill(*spill) if spill is not None else None
    return build(skeleton, views(buf, smap, layout), values)
