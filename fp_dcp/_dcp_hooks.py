"""Every place fp_dcp depends on torch internals, each checked by what it needs
(:func:`check_storage_hooks`, :func:`check_planner_hooks`,
:func:`check_dtensor_hooks`), not by version: a moved hook is a
``RuntimeError`` naming it when a feature needs it.  The numbered hooks are
listed in docs/ARCHITECTURE.md ("DCP's private hooks")."""


from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
from typing import Any, Iterator

log = logging.getLogger("fp_dcp")
_lock = threading.RLock()
_checked: dict[str, str | None] = {}  # hook -> None (it fits the installed torch) or what is missing

__all__ = [
    "check_storage_hooks",
    "check_planner_hooks",
    "check_dtensor_hooks",
    "use_as_default",
    "restore_default",
    "default_storage",
    "is_default",
]

DEFAULT_STORAGE_ENV = "FP_DCP_DEFAULT_STORAGE"


def _require(hook: str, check: Any, feature: str) -> None:
    """Run ``check`` (one of the ``check_*`` functions) once per process;
    raise ``RuntimeError`` naming ``feature`` and the missing hook if it
    failed."""
    with _lock:
        if hook not in _checked:
            try:
                check()
            except RuntimeError as e:
                _checked[hook] = str(e)
            else:
                _checked[hook] = None
        problem = _checked[hook]
    if problem is not None:
        import torch

        raise RuntimeError(
            f"fp_dcp: {feature} needs a torch internal that torch {torch.__version__} does not have: {problem}. "
            f"Use a torch release with it (fp_dcp's tests check each one: tests/test_compat.py), or do "
            f"without {feature}."
        )


# ----------------------------------------------------- 1. storage selection


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"torch.distributed.checkpoint.{name}")


def _storage_modules() -> tuple[Any, Any]:
    return _module("_storage_utils"), _module("format_utils")


# (module, name) the switch rebinds; _saved: the stock object bound there before
_HOOK_NAMES = (("_storage_utils", "FileSystemWriter"), ("_storage_utils", "FileSystemReader"),
               ("format_utils", "FileSystemWriter"), ("format_utils", "FileSystemReader"),
               ("state_dict_saver", "_ProcessBasedAsyncCheckpointExecutor"),
               ("state_dict_saver", "_ThreadBasedAsyncCheckpointExecutor"))
_saved: dict[tuple[str, str], Any] = {}
_current: dict[str, Any] | None = None  # the options of the switch, None when off


def check_storage_hooks() -> None:
    """Check that the installed torch still selects storage the way the
    switch expects (see the module documentation); raise ``RuntimeError``
    naming what moved."""
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.state_dict_saver as saver
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    su, fu = _storage_modules()
    problems = []
    setup = getattr(su, "_storage_setup", None)
    if setup is None:
        problems.append("torch.distributed.checkpoint._storage_utils._storage_setup is gone")
    else:
        for name in ("FileSystemWriter", "FileSystemReader"):
            if name not in setup.__code__.co_names:
                problems.append(f"_storage_setup no longer looks up {name} in its module")
        if getattr(saver, "_storage_setup", None) is not setup:
            problems.append("state_dict_saver no longer calls _storage_utils._storage_setup")
        if getattr(loader, "_storage_setup", None) is not setup:
            problems.append("state_dict_loader no longer calls _storage_utils._storage_setup")
    for fn, name in (("dcp_to_torch_save", "FileSystemReader"), ("torch_save_to_dcp", "FileSystemWriter")):
        f = getattr(fu, fn, None)
        if f is None or name not in f.__code__.co_names:
            problems.append(f"format_utils.{fn} no longer builds {name} from its module's name")
    import inspect

    from torch.distributed.checkpoint._async_process_executor import _ProcessBasedAsyncCheckpointExecutor
    from torch.distributed.checkpoint._async_thread_executor import _ThreadBasedAsyncCheckpointExecutor

    stock: dict[str, Any] = {"FileSystemWriter": FileSystemWriter, "FileSystemReader": FileSystemReader,
             "_ProcessBasedAsyncCheckpointExecutor": _ProcessBasedAsyncCheckpointExecutor,
             "_ThreadBasedAsyncCheckpointExecutor": _ThreadBasedAsyncCheckpointExecutor}
    for name in ("_ProcessBasedAsyncCheckpointExecutor", "_ThreadBasedAsyncCheckpointExecutor"):
        if name not in inspect.unwrap(saver.async_save).__code__.co_names:
            problems.append(f"async_save no longer builds {name} from its module's name")
        elif not {"checkpoint_id", "storage_writer"} <= set(inspect.signature(stock[name].execute_save).parameters):
            problems.append(f"{name}.execute_save takes no checkpoint_id / storage_writer")
    with _lock:
        for mod_name, name in _HOOK_NAMES:
            mod = _module(mod_name)
            bound = _saved.get((mod_name, name), getattr(mod, name, None))
            if bound is not stock[name]:
                problems.append(f"torch.distributed.checkpoint.{mod_name}.{name} is not the stock class")
    if problems:
        import torch

        raise RuntimeError(
            f"fp_dcp's default-storage switch does not fit torch {torch.__version__}: " + "; ".join(problems)
        )


def _stock(name: str) -> Any:
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, name)


class _DefaultWriter:
    """Stands where DCP looks for ``FileSystemWriter``: makes a
    ``FastPersistWriter`` for a local path."""

    def __new__(cls, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        from fp_dcp.save.writer import FastPersistWriter

        opts = _current or {}
        return FastPersistWriter(path, options=opts.get("options"), **opts.get("kwargs", {}))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _stock("FileSystemWriter").validate_checkpoint_id(checkpoint_id)


_executor_classes: dict[str, Any] = {}


def _executor(name: str) -> Any:
    """DCP's async executor ``name``, handing the save fp_dcp's writer when
    ``async_save`` got none and the switch was on *at the call*."""
    cls = _executor_classes.get(name)
    if cls is None:
        base: type
        if name == "_ProcessBasedAsyncCheckpointExecutor":
            from torch.distributed.checkpoint._async_process_executor import (
                _ProcessBasedAsyncCheckpointExecutor as base,
            )
        else:
            from torch.distributed.checkpoint._async_thread_executor import _ThreadBasedAsyncCheckpointExecutor as base

        class _WithDefaultStorage(base):  # type: ignore[misc,valid-type]
            def execute_save(self, staging_future_or_state_dict: Any, *, checkpoint_id: Any = None,
                             storage_writer: Any = None, **kwargs: Any) -> Any:
                if (storage_writer is None and checkpoint_id is not None and _current is not None
                        and _DefaultWriter.validate_checkpoint_id(checkpoint_id)):
                    storage_writer = _DefaultWriter(checkpoint_id)
                return super().execute_save(
                    staging_future_or_state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs
                )

        _WithDefaultStorage.__name__ = _WithDefaultStorage.__qualname__ = f"{base.__name__}WithDefaultStorage"
        cls = _executor_classes[name] = _WithDefaultStorage
    return cls


def _replacement(name: str) -> Any:
    if name == "FileSystemWriter":
        return _DefaultWriter
    if name == "FileSystemReader":
        return _DefaultReader
    return _executor(name)


def checkpoint_kind(path: str | os.PathLike) -> str | None:
    """``"fp_dcp"``, ``"stock"`` or None: which committed checkpoint the
    directory ``path`` holds (by its metadata file; the newer one if both)."""
    from fp_dcp import format as fmt

    p = os.fspath(path)
    mtimes = {}
    for kind, name in (("fp_dcp", fmt.METADATA_NAME), ("stock", fmt.STOCK_METADATA_NAME)):
        try:
            mtimes[kind] = os.stat(os.path.join(p, name)).st_mtime_ns
        except OSError:
            pass
    if not mtimes:
        return None
    return max(mtimes, key=lambda k: (mtimes[k], k == "fp_dcp"))


class _DefaultReader:
    """Stands where DCP looks for ``FileSystemReader``: a
    ``FastPersistReader`` for an fp_dcp checkpoint, else the stock reader with
    restricted unpicklers (``fp_dcp.load.stock.SafeStockReader``)."""

    def __new__(cls, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        opts = _current or {}
        if checkpoint_kind(path) == "fp_dcp":
            from fp_dcp.load.reader import FastPersistReader

            return FastPersistReader(path, options=opts.get("options"), **opts.get("kwargs", {}))
        from fp_dcp.load.stock import SafeStockReader
        from fp_dcp.options import FastPersistOptions

        options = opts.get("options") or FastPersistOptions.from_env(**opts.get("kwargs", {}))
        return SafeStockReader(path, *args, allow_pickle=options.allow_pickle, **kwargs)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _stock("FileSystemReader").validate_checkpoint_id(checkpoint_id)


def use_as_default(options: Any = None, **option_kwargs: Any) -> None:
    """Make fp_dcp the storage DCP picks for a local ``checkpoint_id`` until
    :func:`restore_default`; ``options`` / keyword arguments as for the writer
    and reader (a second call replaces them).  Stock checkpoints still load."""
    global _current
    check_storage_hooks()
    if options is not None or option_kwargs:  # fail now on a bad option, not at the first save
        from fp_dcp.options import FastPersistOptions

        base = options if options is not None else FastPersistOptions.from_env()
        base.replace(**option_kwargs)
    from fp_dcp import planners

    with _lock:
        for mod_name, name in _HOOK_NAMES:
            mod = _module(mod_name)
            if (mod_name, name) not in _saved:
                _saved[(mod_name, name)] = getattr(mod, name)
            setattr(mod, name, _replacement(name))
        planners.install_as_default(_saved, _module)  # a dcp.save/load given no planner gets fp_dcp's
        _current = {"options": options, "kwargs": dict(option_kwargs)}


def restore_default() -> None:
    """Undo :func:`use_as_default`: DCP picks its stock storage again."""
    global _current
    with _lock:
        if _saved:
            for (mod_name, name), value in _saved.items():
                setattr(_module(mod_name), name, value)
            _saved.clear()
        _current = None


def is_default() -> bool:
    """Whether the switch is on."""
    return _current is not None


@contextlib.contextmanager
def default_storage(options: Any = None, **option_kwargs: Any) -> Iterator[None]:
    """``with fp_dcp.default_storage(): ...``: the switch on inside the
    block, back to what it was (off, or on with other options) after it."""
    with _lock:
        before = None if _current is None else dict(_current)
        use_as_default(options, **option_kwargs)
    try:
        yield
    finally:
        with _lock:
            if before is None:
                restore_default()
            else:
                use_as_default(before["options"], **before["kwargs"])


def _from_environment() -> None:
    """``FP_DCP_DEFAULT_STORAGE=1``: the switch on when fp_dcp is imported."""
    value = os.environ.get(DEFAULT_STORAGE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    if value not in ("1", "true", "yes", "on"):
        raise ValueError(f"{DEFAULT_STORAGE_ENV}={value!r}: use 1 (on) or 0 (off)")
    use_as_default()


# ------------------------------- plan caching (hook 5), the global metadata (hook 7)


def planner_cache_key(planner: Any) -> str | None:
    """DCP's plan-cache key of ``planner`` if it caches plans
    (``DefaultSavePlanner(enable_plan_caching=True)``), else None."""
    if not getattr(planner, "_enable_plan_caching", False):
        return None
    _require("DefaultSavePlanner._cached_plans_key", check_planner_hooks, "FastPersistWriter with DCP's plan caching")
    return str(getattr(planner, "_cached_plans_key", type(planner).__name__))


def planner_metadata(planner: Any) -> Any:
    """The global metadata ``planner`` made in ``create_global_plan`` (the
    object DCP passes to the writer's ``finish``), or None where it keeps
    none (another planner, a rank other than the coordinator)."""
    from torch.distributed.checkpoint.metadata import Metadata

    md = getattr(planner, "metadata", None)
    return md if isinstance(md, Metadata) else None


def check_planner_hooks() -> None:
    """Check that DefaultSavePlanner still exposes what
    :func:`planner_cache_key` and :func:`planner_metadata` read; raise
    ``RuntimeError`` if not."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    on, off = DefaultSavePlanner(enable_plan_caching=True), DefaultSavePlanner()
    if getattr(on, "_enable_plan_caching", None) is not True or getattr(off, "_enable_plan_caching", None) is not False:
        raise RuntimeError("DefaultSavePlanner no longer records enable_plan_caching as _enable_plan_caching")
    if not isinstance(getattr(on, "_cached_plans_key", None), str):
        raise RuntimeError("DefaultSavePlanner no longer has its plan-cache key in _cached_plans_key")
    off.set_up_planner({"x": 1}, None, True)
    _, metadata = off.create_global_plan([off.create_local_plan()])
    if planner_metadata(off) is not metadata:
        raise RuntimeError("DefaultSavePlanner no longer keeps create_global_plan's metadata in .metadata")


# ------------------------------------------------- 2. the caller of stage()


def async_save_caller() -> tuple[bool, str | None]:
    """Whether ``stage`` was called by ``dcp.async_save``, and that call's
    ``checkpoint_id``; ``(False, None)`` without such a frame (hook 2).  The
    search starts two frames up (the writer's ``stage``)."""
    import sys

    f: types.FrameType | None = sys._getframe(2)
    for _ in range(8):
        if f is None:
            break
        in_dcp = f.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint")
        if f.f_code.co_name == "async_save" and in_dcp:
            cid = f.f_locals.get("checkpoint_id")
            return True, (os.fspath(cid) if isinstance(cid, (str, os.PathLike)) else None)
        f = f.f_back
    return False, None


# ------------------------------------------- 8. errors a load may swallow


def logged_metadata_errors(read_metadata: Any) -> Any:
    """Decorate a reader's ``read_metadata``: its exception is logged at ERROR
    (``fp_dcp`` logger, once per reader until a read succeeds) and raised as
    it was, except to a DCP load step that would swallow it (hook 8)."""

    @functools.wraps(read_metadata)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            metadata = read_metadata(self, *args, **kwargs)
        except Exception as e:
            key = (type(e), str(e))
            if getattr(self, "_fp_logged_error", None) != key:
                self._fp_logged_error = key
                log.error("fp_dcp cannot load the checkpoint at %s: %s: %s", getattr(self, "path", "?"),
                          type(e).__name__, e)
            first = getattr(self, "_fp_first_error", None)
            self._fp_first_error = e
            if "rank" in kwargs and first is not None and _swallowed_by_load_step(first):
                return _UnreadMetadata(e)
            raise
        self._fp_logged_error = self._fp_first_error = None
        return metadata

    return wrapper


def _swallowed_by_load_step(first: BaseException) -> bool:
    """Whether the caller of the decorated ``read_metadata`` is DCP's load
    step and holds no reference to ``first`` (the exception of the read it
    is retrying), so it cannot report it."""
    import sys

    f = sys._getframe(2)  # this, the wrapper, the caller
    if f is None or f.f_code.co_name != "local_step" or not f.f_globals.get("__name__", "").startswith(
            "torch.distributed.checkpoint.state_dict_loader"):
        return False
    return not any(v is first for v in f.f_locals.values())


class _UnreadMetadata:
    """Stands for metadata that could not be read: any use of it raises the
    reader's exception."""

    __slots__ = ("_fp_error",)

    def __init__(self, error: BaseException) -> None:
        object.__setattr__(self, "_fp_error", error)

    def __getattr__(self, name: str) -> Any:
        raise object.__getattribute__(self, "_fp_error")

    def __bool__(self) -> bool:
        return True


# ----------------------------------------------------- 3. DTensor internals


def dtensor_local(t: Any) -> Any:
    """A DTensor's local shard, detached (public: ``to_local``)."""
    return t.to_local().detach()


def dtensor_spec(t: Any) -> Any:
    """What :func:`dtensor_from_spec` needs to rebuild ``t`` around another
    local tensor (private: ``DTensor._spec``; compared with ``==``)."""
    _require("DTensor._spec", check_dtensor_hooks, "fp_dcp's staging of DTensors")
    return t._spec


def check_dtensor_hooks() -> None:
    """Check that ``DTensor`` still keeps its spec in ``_spec`` and takes
    ``(local_tensor, spec, requires_grad=)``; raise ``RuntimeError`` if not."""
    import inspect

    from torch.distributed.tensor import DTensor

    if "_spec" not in getattr(DTensor, "__slots__", ()) and "_spec" not in getattr(DTensor, "__annotations__", {}):
        raise RuntimeError("DTensor no longer keeps its placement spec in DTensor._spec")
    try:
        params = inspect.signature(DTensor.__new__).parameters
    except (TypeError, ValueError):  # a C constructor: no signature to read
        return
    if params and not {"spec", "requires_grad"} <= set(params) and not any(
            p.kind is p.VAR_POSITIONAL for p in params.values()):
        raise RuntimeError("DTensor(local_tensor, spec, requires_grad=) is no longer DTensor's constructor")


def dtensor_from_spec(local: Any, spec: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if spec.mesh.device_type == local.device.type:
        return DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
    # from_local would move the staged shard back to the mesh's device; build
    # the DTensor around the host copy as torch's own staging does.
    return DTensor(local, spec, requires_grad=False)
