"""Errors arrive whole, and ranks exchange plain data.

Attacks and careless inputs in the style of ``tests/test_security.py``: every
fp_dcp exception survives pickling (DCP gathers a rank's error with pickle),
the CLI answers every failure with one line, every environment name the docs
mention is accepted, and the shared reads' error exchange is plain data that
a lying peer cannot turn into code.  Bounded inputs and plain-data objects:
``tests/test_trust_inputs.py``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

import fp_dcp
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


# ------------------------------------------------------------ the CLI: one line, every failure


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "fp_dcp", *argv], capture_output=True, text=True, env=_ENV,
                          timeout=300)


def _one_line_failure(r, *names):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for name in names:
        assert name in lines[0], r.stderr
    return lines[0]


def _fp_dcp_ckpt(path):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter
    from fp_dcp.load.reader import read_checkpoint_metadata

    dcp.save({"w": torch.arange(200_000, dtype=torch.float32), "step": 3},
             storage_writer=FastPersistWriter(str(path)), no_dist=True)
    _, layout, _ = read_checkpoint_metadata(str(path))
    return os.path.join(str(path), layout.files[0][0])


def test_cli_convert_of_a_damaged_checkpoint_is_one_line(tmp_path):
    """A checksum mismatch during convert's load reaches the CLI as DCP's
    CheckpointException (a BaseException): one line naming the file, exit 1."""
    data_file = _fp_dcp_ckpt(tmp_path / "c")
    flip_byte(data_file, 100)
    line = _one_line_failure(_cli("convert", "-q", str(tmp_path / "c"), str(tmp_path / "out.pt")),
                             data_file, "checksum mismatch")
    assert line.startswith("fp-dcp convert: ")
    assert not os.path.exists(tmp_path / "out.pt")


def test_cli_convert_of_a_truncated_checkpoint_is_one_line(tmp_path):
    data_file = _fp_dcp_ckpt(tmp_path / "c")
    os.truncate(data_file, 1000)
    _one_line_failure(_cli("convert", "-q", str(tmp_path / "c"), str(tmp_path / "out.pt")), data_file, "truncated")


def test_cli_convert_of_a_truncated_stock_checkpoint_names_the_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(1000.0), "step": 3}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")),
             no_dist=True)
    (data,) = [n for n in os.listdir(tmp_path / "s") if n.endswith(".distcp")]
    os.truncate(tmp_path / "s" / data, 100)
    _one_line_failure(_cli("convert", "-q", "--from-dcp", str(tmp_path / "s"), str(tmp_path / "o")),
                      str(tmp_path / "s" / data), "truncated")
    assert not os.path.exists(tmp_path / "o")


def test_cli_turns_a_checkpoint_exception_into_its_first_failure(monkeypatch, capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    from fp_dcp.tools import cli

    err = ChecksumError("checksum mismatch in w at offset 4096 of /ckpt/a.r0.0.fpd", "/ckpt/a.r0.0.fpd", _bad())

    def fail(args):
        raise CheckpointException("load failed", {1: (ValueError("second"), None), 0: (err, None)})

    monkeypatch.setattr(cli, "_inspect", fail)
    assert cli.main(["inspect", "/nowhere"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["fp-dcp inspect: /ckpt/a.r0.0.fpd: checksum mismatch in w at offset 4096 of /ckpt/a.r0.0.fpd "
                     "(2 ranks failed)"], lines


# ------------------------------------------------------------ environment names


_NOT_OPTION_VALUES = {"FP_DCP_DEFAULT_STORAGE": "0", "FP_DCP_ALLOW_UNTESTED_TORCH": "0",
                      "FP_DCP_TUNING_FILE": "none", "FP_DCP_TEST_HOOKS": "0", "FP_DCP_RANKS_PER_NODE": "2",
                      "FP_DCP_KEEP_BOUNCE_BUFFERS": "64MiB"}


def _documented_env_names() -> set[str]:
    names: set[str] = set()
    for doc in [os.path.join(REPO, "README.md")] + [os.path.join(REPO, "docs", n)
                                                   for n in os.listdir(os.path.join(REPO, "docs"))]:
        if doc.endswith(".md"):
            names.update(re.findall(r"FP_DCP_[A-Z][A-Z_]*[A-Z]", open(doc, encoding="utf-8").read()))
    return names


def test_every_environment_name_the_docs_mention_is_accepted(monkeypatch):
    from fp_dcp.options import _NOT_OPTIONS, FastPersistOptions

    names = _documented_env_names()
    assert "FP_DCP_RANKS_PER_NODE" in names and "FP_DCP_ENGINE" in names
    fields = set(FastPersistOptions.field_names())
    for name in sorted(names):
        option = name[len("FP_DCP_"):].lower()
        assert option in fields or name in _NOT_OPTIONS, f"{name} is in the docs but names no option"
        if name in _NOT_OPTIONS:
            assert name in _NOT_OPTION_VALUES, f"{name}: add a harmless value to _NOT_OPTION_VALUES"
            monkeypatch.setenv(name, _NOT_OPTION_VALUES[name])
            FastPersistOptions.from_env()  # no error
            monkeypatch.delenv(name)


# ------------------------------------------------------------ no pickle between the ranks of a shared read


def test_no_pickled_collective_in_the_load_path():
    """fp_dcp's own collectives of a load send plain data: no *_object
    collective (pickle) is called under fp_dcp/load/."""
    import ast

    pickled = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
               "send_object_list", "recv_object_list"}
    root = os.path.join(REPO, "fp_dcp", "load")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                tree = ast.parse(open(path, encoding="utf-8").read())
                calls = [n.func.attr for n in ast.walk(tree)
                         if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in pickled]
                assert not calls, f"{os.path.relpath(path, REPO)} calls {calls}: send plain data instead"


def test_peer_messages_round_trip_and_malformed_ones_are_named():
    import struct

    from fp_dcp.load.sharing.messages import (MESSAGE_ROW_BYTES, MESSAGE_TEXT_BYTES, PeerMessageError,
                                              decode_text, encode_text)

    for text in (None, "", "ChecksumError: w: bytes 0..1048576 of /ckpt/a.r0.0.fpd", "ünïcødé ✓"):
        row = encode_text(text)
        assert len(row) == MESSAGE_ROW_BYTES and decode_text(row, 1) == text
    long = "é" * MESSAGE_TEXT_BYTES  # 2 bytes each: cut at a character boundary
    assert decode_text(encode_text(long), 1) == "é" * (MESSAGE_TEXT_BYTES // 2)
    bad = [
        (struct.pack("<BI", 1, 1 << 30) + bytes(MESSAGE_TEXT_BYTES), "malformed message"),
        (struct.pack("<BI", 7, 3) + b"abc" + bytes(MESSAGE_TEXT_BYTES - 3), "malformed message"),
        (struct.pack("<BI", 1, 2) + b"\xff\xfe" + bytes(MESSAGE_TEXT_BYTES - 2), "not UTF-8"),
        (pickle.dumps(ValueError("x")), "bytes, not"),
    ]
    for row, words in bad:
        with pytest.raises(PeerMessageError, match=f"rank 3 .*{words}"):
            decode_text(row, 3)


def _lying_peer(rank, ws, marker):
    """Rank 1 sends a pickle (that would create ``marker``) where a text row
    belongs; rank 0 gets a named error, and nothing runs."""
    import torch.distributed as dist

    from fp_dcp.load.sharing.messages import MESSAGE_ROW_BYTES, PeerMessageError, gather_texts

    if rank == 1:
        evil = b"cposix\nsystem\n(X" + len(f"touch {marker}").to_bytes(4, "little") + f"touch {marker}".encode()
        evil += b"tR."
        row = torch.zeros(MESSAGE_ROW_BYTES, dtype=torch.uint8)
        row[:len(evil)] = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
        dist.all_gather([torch.empty_like(row) for _ in range(ws)], row)
        return True
    try:
        gather_texts("a real error", None, ws, "cpu")
    except PeerMessageError as e:
        assert "rank 1" in str(e), e
        return not os.path.exists(marker)
    raise AssertionError("a malformed message from a peer was accepted")


@pytest.mark.slow  # multi-process
def test_a_lying_peer_is_a_named_error_not_code(tmp_path):
    marker = str(tmp_path / "PWNED")
    assert run_ranks(2, _lying_peer, marker) == [True, True]
    assert not os.path.exists(marker)


def test_the_cli_drops_exactly_the_readers_own_error_log():
    """The CLI prints a failed load's reason once: the reader's ERROR log of it
    (for torch releases that swallow it) is what its filter recognises."""
    import inspect

    from fp_dcp import _dcp_hooks
    from fp_dcp.tools import cli

    assert f'log.error("{cli._READER_ERROR} ' in inspect.getsource(_dcp_hooks.logged_metadata_errors)
