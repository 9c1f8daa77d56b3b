"""DCP planners that make the plans DCP's default planners make, faster.

    dcp.save(sd, storage_writer=w, planner=FastPersistSavePlanner())
    dcp.load(sd, storage_reader=r, planner=FastPersistLoadPlanner())

They are pure DCP planners: they work with any storage (DCP's own
``FileSystemWriter`` / ``FileSystemReader`` too) and produce the same local
plans, global plans and ``Metadata`` as ``DefaultSavePlanner`` /
``DefaultLoadPlanner`` with the same arguments.  With fp_dcp's default-storage
switch on (``fp_dcp.use_as_default()``, ``FP_DCP_DEFAULT_STORAGE=1``,
``python -m fp_dcp.launch``), ``dcp.save`` / ``dcp.load`` called without a
planner use them; a planner passed explicitly is used as given.

Making one of these planners also makes ``dcp.save`` copy the state dict
without DCP's per-key debug records while nobody receives them, and
``dcp.load`` check values against ``Stateful`` faster: the same results,
the same ``state_dict()`` calls (:mod:`fp_dcp._stateful`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from fp_dcp import _stateful
from fp_dcp.planners.load import FastPersistLoadPlanner
from fp_dcp.planners.save import FastPersistSavePlanner

__all__ = ["FastPersistSavePlanner", "FastPersistLoadPlanner", "install_as_default", "DEFAULT_NAMES"]

# (DCP module, name): where dcp.save / dcp.load find the planner they make
# when the caller passes none.
DEFAULT_NAMES = (("state_dict_saver", "DefaultSavePlanner", FastPersistSavePlanner),
                 ("state_dict_loader", "DefaultLoadPlanner", FastPersistLoadPlanner))


def _binds_default(module: Any, name: str) -> bool:
    """Whether ``module`` makes its default planner from its own global
    ``name`` (so rebinding that name changes the default, nothing else)."""
    import inspect

    fn = getattr(module, "_save_state_dict" if name == "DefaultSavePlanner" else "_load_state_dict", None)
    try:
        return fn is not None and name in inspect.unwrap(fn).__code__.co_names
    except AttributeError:
        return False


def install_as_default(saved: dict[tuple[str, str], Any], module: Callable[[str], Any] | None = None) -> list[str]:
    """Make ``dcp.save`` / ``dcp.load`` use these planners when called without
    one, by rebinding the names DCP makes its default planner from, and
    ``dcp.save`` copy the state dict without DCP's per-key debug logging
    while nobody receives it and ``dcp.load`` check for ``Stateful``
    values quickly (:mod:`fp_dcp._stateful`).  The
    stock objects go into ``saved`` (``(module, name) -> object``, kept if
    already there) for the default-storage switch to restore.  Returns what
    was not installed (a torch that makes its default planner elsewhere):
    that default stays DCP's."""
    module = module or (lambda name: importlib.import_module(f"torch.distributed.checkpoint.{name}"))
    skipped = []
    for mod_name, name, ours in DEFAULT_NAMES:
        mod = module(mod_name)
        if not _binds_default(mod, name):
            skipped.append(f"{mod_name}.{name}")
            continue
        saved.setdefault((mod_name, name), getattr(mod, name))
        setattr(mod, name, ours)
    # the copy of the state dict dcp.save makes before planning, without its
    # per-key logging, and dcp.load's protocol check, made quick
    skipped += _stateful.install(saved, module)
    return skipped
