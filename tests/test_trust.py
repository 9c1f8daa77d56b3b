"""Errors arrive whole, inputs cost what they honestly are, plain data loads.

Attacks and careless inputs on what surrounds the core load path, in the
style of ``tests/test_security.py``: every fp_dcp exception survives pickling
(DCP gathers a rank's error with pickle), the CLI answers every failure with
one line, every environment name the docs mention is accepted, metadata that
claims more than it holds is refused before it costs memory, options cannot
ask for more memory than a machine has, ``io.BytesIO`` train state (PyTorch's
own end-to-end DCP test) loads with no option, and the shared reads' error
exchange is plain data, not pickle.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

import fp_dcp
from fp_dcp import format as fmt
from fp_dcp.checksums import BadBlock, ChecksumError
from tests._dist import run_ranks
from tests._sd import FAILED, flip_byte, root_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ------------------------------------------------------------ errors that arrive whole


def _fp_dcp_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in fp_dcp (all its modules imported)."""
    for info in pkgutil.walk_packages(fp_dcp.__path__, "fp_dcp."):
        if not info.name.endswith("__main__"):  # runs the CLI
            importlib.import_module(info.name)

    def walk(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    found = {c for c in walk(BaseException) if c.__module__.split(".")[0] == "fp_dcp"}
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _bad() -> list[BadBlock]:
    return [BadBlock("w", "/ckpt/a.r0.0.fpd", 4096, 0, 1 << 20, 0x1234, 0x5678),
            BadBlock("w", "/ckpt/a.r0.0.fpd", 4096 + (1 << 20), 1 << 20, 1 << 20, 1, 2)]


def _integrity_error():
    from fp_dcp.tiers.integrity import IntegrityError

    return IntegrityError("/tier/step_3/a.r0.0.fpd", "short: 10 of 4096 bytes")


# An fp_dcp exception whose constructor is its own (not a built-in one taking
# the message) needs a sample here, and a __reduce__ that rebuilds it.
_SAMPLES = {
    "fp_dcp.checksums.ChecksumError": lambda: ChecksumError(
        "checksum mismatch in w: bytes 0..1048576 at offset 4096 of /ckpt/a.r0.0.fpd", "/ckpt/a.r0.0.fpd", _bad()),
    "fp_dcp.tiers.integrity.IntegrityError": _integrity_error,
}


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def _own_init(cls) -> bool:
    return any("__init__" in vars(c) for c in cls.__mro__ if c.__module__.split(".")[0] == "fp_dcp")


@pytest.mark.parametrize("cls", _fp_dcp_exceptions(), ids=lambda c: c.__qualname__)
def test_every_fp_dcp_exception_round_trips_through_pickle(cls):
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _own_init(cls):
        assert name in _SAMPLES, (
            f"{name} has its own __init__: add a sample to _SAMPLES and a __reduce__ that rebuilds it "
            f"(DCP sends a rank's error to the others by pickle)"
        )
        err = _SAMPLES[name]()
    else:
        err = cls(f"{name}: what went wrong, in /ckpt/file, and the fix")
        err.tensor = "w"  # a field set by a raiser travels too
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is cls and str(back) == str(err) and back.args == err.args
        assert {k: _plain(v) for k, v in vars(back).items()} == {k: _plain(v) for k, v in vars(err).items()}
        if isinstance(err, OSError):
            assert (back.errno, back.strerror, back.filename) == (err.errno, err.strerror, err.filename)


def test_a_checksum_error_keeps_its_fields_through_pickle():
    err = _SAMPLES["fp_dcp.checksums.ChecksumError"]()
    back = pickle.loads(pickle.dumps(err))
    assert (back.tensor, back.file_offset, back.length) == ("w", 4096, 1 << 20)
    assert [b.as_dict() for b in back.bad_blocks] == [b.as_dict() for b in _bad()]
    assert back.errno == 5 and back.filename == "/ckpt/a.r0.0.fpd" and "checksum mismatch in w" in str(back)


def _damaged_multirank_load(rank, ws, root):
    """Each rank loads its own shard; rank 0's shard has a damaged byte. DCP
    gathers rank 0's ChecksumError by pickle: every rank must name the file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistReader, FastPersistWriter
    from fp_dcp.load.reader import read_checkpoint_metadata

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
    path = os.path.join(root, "bad")
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=FastPersistWriter(path))
    _, layout, _ = read_checkpoint_metadata(path)
    ext = next(exts[0] for index, exts in layout.extents.items() if index.fqn == "w" and not any(index.offset))
    data_file = os.path.join(path, layout.files[ext.file][0])
    dist.barrier()
    if rank == 0:
        flip_byte(data_file, ext.file_offset + 100)
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(512, 1024), mesh, [Shard(0)])}
    try:
        dcp.load(target, storage_reader=FastPersistReader(path, share_replicated_reads=False,
                                                          share_interleaved_reads=False))
    except FAILED as e:
        text = str(e)
        assert "AttributeError" not in text and "object has no attribute" not in text, text
        first = root_error(e)
        assert isinstance(first, ChecksumError), text
        assert first.filename == data_file and first.tensor == "w" and data_file in str(first), text
        return True
    raise AssertionError("a damaged block did not fail the load")


@pytest.mark.slow  # multi-process
def test_a_damaged_file_is_named_on_every_rank_of_a_multirank_load(tmp_path):
    assert run_ranks(2, _damaged_multirank_load, str(tmp_path)) == [True, True]
