"""fp-dcp export-hf / fp_dcp.export_hf: Hugging Face's sharded safetensors
layout from fp_dcp and stock DCP checkpoints, bit-exact, byte for byte what
safetensors writes, from one process or from several ranks."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp.tools import cli
from fp_dcp.tools.export_hf import (
    INDEX_NAME,
    ExportError,
    _batches,
    assign_shards,
    export_hf,
    parse_shard_size,
    plan_export,
)
from tests._dist import run_ranks


def _state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(257 + i, 61, generator=g) for i in range(5)}
    model["layers.0.weight"][0, :4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-45])
    model.update({
        "embed.weight": torch.randn(301, 33, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(61, generator=g).half(),
        "ids": torch.randint(-100, 100, (1001,), dtype=torch.int8, generator=g),
        "position": torch.arange(333, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scale": torch.tensor(2.5),
        "empty": torch.empty(0, 5),
    })
    return {"model": model, "step": 11, "extra": {"note": "not a tensor"}}


def _flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).numpy())


def _save_fp_dcp(path, sd=None):
    from fp_dcp import FastPersistWriter

    dcp.save(sd if sd is not None else _state_dict(), storage_writer=FastPersistWriter(str(path)), no_dist=True)
    return str(path)


def _read_export(out) -> dict:
    """Every tensor of an export, through the files the index (or the single file) names."""
    from safetensors.torch import load_file

    if os.path.exists(os.path.join(out, INDEX_NAME)):
        with open(os.path.join(out, INDEX_NAME)) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {k: "model.safetensors" for k in load_file(os.path.join(out, "model.safetensors"))}
    got: dict = {}
    for name in sorted(set(weight_map.values())):
        part = load_file(os.path.join(out, name))
        assert {k for k, v in weight_map.items() if v == name} == set(part)
        assert not set(part) & set(got), "a tensor in two files"
        got.update(part)
    return got


@pytest.mark.parametrize("direct_io", [None, False])
def test_sharded_export_is_bit_exact_and_what_safetensors_writes(tmp_path, direct_io):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    out = str(tmp_path / "hf")
    limit = 150_000
    # batches far smaller than the files: tensors straddle batch boundaries
    r = export_hf(ckpt, out, max_shard_size=limit, batch_bytes=20_000, direct_io=direct_io)
    want = _flat(_state_dict())
    got = _read_export(out)
    assert set(got) == set(want)
    for k in want:
        assert _same_bits(got[k], want[k]), k
    assert sorted(r["skipped"]) == ["extra.note", "step"]
    with open(os.path.join(out, INDEX_NAME), "rb") as f:
        raw = f.read()
    index = json.loads(raw)
    # transformers' save_pretrained writes the index this way
    assert raw == (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in want.values())}
    assert set(index["weight_map"]) == set(want)
    names = sorted(set(index["weight_map"].values()))
    n = len(names)
    assert n > 2 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(out)) == sorted(names + [INDEX_NAME])  # no temporaries left
    for name in names:
        part = safetensors_torch.load_file(os.path.join(out, name))
        data = sum(t.numel() * t.element_size() for t in part.values())
        assert data <= limit or len(part) == 1
        with open(os.path.join(out, name), "rb") as f:
            assert f.read() == safetensors_torch.save(part, metadata={"format": "pt"}), name


def test_shards_split_as_huggingface_hub_splits(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", max_shard_size="100KB")
    with open(tmp_path / "hf" / INDEX_NAME) as f:
        ours = json.load(f)
    want = _flat(_state_dict())
    split = hub.split_torch_state_dict_into_shards(want, max_shard_size="100KB")
    assert ours["weight_map"] == split.tensor_to_filename
    assert ours["metadata"]["total_size"] == split.metadata["total_size"]


def test_golden_bytes_of_a_small_file(tmp_path):
    sd = {"b": torch.tensor([1, 2, 3], dtype=torch.int8), "a": torch.tensor([1.0], dtype=torch.float32)}
    ckpt = _save_fp_dcp(tmp_path / "ckpt", sd)
    export_hf(ckpt, tmp_path / "hf")
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]  # one shard: no index, as HF writes it
    header = (b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
              b'"b":{"dtype":"I8","shape":[3],"data_offsets":[4,7]}}')
    header += b" " * (-len(header) % 8)
    expected = struct.pack("<Q", len(header)) + header + struct.pack("<f", 1.0) + bytes([1, 2, 3])
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == expected


def test_dtype_cast_touches_floating_point_tensors_only(tmp_path):
    pytest.importorskip("safetensors")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", dtype="bf16", max_shard_size="50KB", batch_bytes=30_000)
    got = _read_export(tmp_path / "hf")
    for k, t in _flat(_state_dict()).items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert _same_bits(got[k], expected), k


def test_prefix_strip_and_key_map(tmp_path):
    pytest.importorskip("safetensors")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    want = _flat(_state_dict())
    r = export_hf(ckpt, tmp_path / "a", strip_prefix="model.",
                  key_map=lambda k: None if k == "ids" else k.replace("layers.", "h."))
    got = _read_export(tmp_path / "a")
    assert set(got) == {k[len("model."):].replace("layers.", "h.") for k in want if k != "model.ids"}
    assert _same_bits(got["h.3.weight"], want["model.layers.3.weight"])
    assert "model.ids" in r["skipped"]
    with pytest.raises(ExportError, match=r"model\.layers\.1\.weight and model\.layers\.0\.weight both become .w."):
        export_hf(ckpt, tmp_path / "b", key_map=lambda k: "w" if "weight" in k else k)
    assert not os.path.exists(tmp_path / "b")


def test_stock_dcp_checkpoint_exports_bit_exact(tmp_path):
    pytest.importorskip("safetensors")
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(_state_dict(), storage_writer=FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    export_hf(tmp_path / "stock", tmp_path / "hf", max_shard_size="120KB", batch_bytes=10_000)
    got = _read_export(tmp_path / "hf")
    want = _flat(_state_dict())
    assert set(got) == set(want)
    assert all(_same_bits(got[k], want[k]) for k in want)


def test_a_link_as_output_is_refused_and_its_target_untouched(tmp_path):
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"theirs")
    link = tmp_path / "link"
    link.symlink_to(target)
    for overwrite in (False, True):
        with pytest.raises(ExportError, match="symbolic link"):
            export_hf(ckpt, link, overwrite=overwrite)
    assert os.listdir(target) == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"theirs"
    # a link where a model file goes is replaced by the file, never written through
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").symlink_to(target / "model.safetensors")
    export_hf(ckpt, out, overwrite=True)
    assert not (out / "model.safetensors").is_symlink()
    assert (target / "model.safetensors").read_bytes() == b"theirs"


def test_existing_output_needs_overwrite_which_removes_stale_model_files_only(tmp_path):
    pytest.importorskip("safetensors")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_size="60KB")
    first = sorted(os.listdir(out))
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors.bak").write_text("keep")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_hf(ckpt, out)
    assert sorted(os.listdir(out)) == sorted(first + ["config.json", "model-00001-of-00002.safetensors.bak"])
    r = export_hf(ckpt, out, overwrite=True)  # now one file
    assert sorted(r["removed"]) == first
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors.bak", "model.safetensors"]
    got = _read_export(out)
    assert all(_same_bits(got[k], v) for k, v in _flat(_state_dict()).items())


@pytest.mark.parametrize("after", [0, 4])
def test_an_io_error_leaves_the_previous_export_whole_and_no_temporary(tmp_path, aio_no_leaks, after):
    import errno

    from fp_dcp import _native

    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_size="1GB")
    before = (out / "model.safetensors").read_bytes()
    _native.testing().set_fault("io", errno.ENOSPC, after)
    try:
        with pytest.raises(OSError) as e:
            export_hf(ckpt, out, overwrite=True, dtype="fp16", batch_bytes=16_384)
    finally:
        _native.testing().set_fault("")
    assert e.value.errno == errno.ENOSPC and e.value.filename
    assert os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == before


def test_cli_exports_and_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    pytest.importorskip("safetensors")
    ckpt = _save_fp_dcp(tmp_path / "ckpt")
    assert cli.main(["export-hf", ckpt, str(tmp_path / "hf"), "--max-shard-size", "0.1MB", "--dtype", "fp16",
                     "--strip-prefix", "model.", "-q"]) == 0
    got = _read_export(tmp_path / "hf")
    assert _same_bits(got["layers.1.weight"], _flat(_state_dict())["model.layers.1.weight"].half())
    assert "skipped 2 item(s)" in capsys.readouterr().err
    data = [n for n in os.listdir(ckpt) if n.endswith(".fpd")][0]
    os.truncate(os.path.join(ckpt, data), 1000)
    assert cli.main(["export-hf", ckpt, str(tmp_path / "again"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fp-dcp export-hf: ") and data in err and "truncated" in err
    assert not os.path.exists(tmp_path / "again")


def test_shard_sizes_parse_as_huggingface_does():
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("2GiB") == 2 << 30
    assert parse_shard_size(" 1.5 kb ") == 1500
    assert parse_shard_size(4096) == 4096
    for bad in ("5XB", "GB", "-1GB", 0, "5 G B"):
        with pytest.raises(ExportError, match="max shard size"):
            parse_shard_size(bad)
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    for s in ("5GB", "10MB", "3KB", "1TB", "0.5GB"):
        assert parse_shard_size(s) == hub.parse_size_to_int(s)


def test_batches_cover_every_file_byte_once_with_aligned_writes():
    sizes = [(f"t{i}", torch.float32 if i % 3 else torch.int8, [1 + (i * 7919) % 5000]) for i in range(200)]
    plan = plan_export(sizes, max_shard_size=200_000)
    for f in plan.files:
        for capacity in (8192 * 3, 1 << 20):
            if capacity < max([t.nbytes for t in f.tensors] + [len(f.header)]) + 4096:
                continue
            pos = 0
            batches = list(_batches(f, capacity, 4096))
            for b in batches:
                assert b.base == pos and b.base % 4096 == 0 and b.end - b.base <= capacity
                assert b.last or b.write_end % 4096 == 0
                pos = b.write_end
            assert pos == f.size and batches[-1].last and sum(b.last for b in batches) == 1
            assert [t for b in batches for t in b.tensors] == list(f.tensors)


def test_a_dtype_safetensors_lacks_is_an_error_naming_the_tensor():
    with pytest.raises(ExportError, match=r"^opt\.z: safetensors has no torch\.complex128; leave it out"):
        plan_export([("w", torch.float32, [2]), ("opt.z", torch.complex128, [3])])
    plan = plan_export([("w", torch.float32, [2]), ("opt.z", torch.complex128, [3])],
                       key_map=lambda k: None if k.startswith("opt.") else k)
    assert plan.skipped == ("opt.z",) and [t.name for f in plan.files for t in f.tensors] == ["w"]


def test_shard_assignment_balances_bytes_the_same_on_every_rank():
    sizes = [5, 9, 1, 9, 3, 7, 2]
    owner = assign_shards(sizes, 3)
    assert owner == assign_shards(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes) and sorted(set(owner)) == [0, 1, 2]
    assert assign_shards(sizes, 1) == [0] * len(sizes)


# ------------------------------------------------------------------ several ranks


def _full(world_size: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(96, 40, generator=g),
        "v": torch.randn(40, 96, generator=g).to(torch.bfloat16),
        "emb": torch.randn(1000, 24, generator=g),
        "replicated": torch.arange(1000, dtype=torch.int64),
    }


def _save_and_export(rank, world_size, ckpt, out, fail_rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistWriter, export_hf

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full(world_size)
    sd = {"model": {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "v": distribute_tensor(full["v"], mesh, [Shard(1)]),
        "emb": distribute_tensor(full["emb"], mesh, [Shard(0)]),
        "replicated": full["replicated"],
    }, "step": 3}
    dcp.save(sd, storage_writer=FastPersistWriter(ckpt))

    def key_map(k):
        if rank == fail_rank:
            raise ValueError(f"no name for {k} on rank {rank}")
        return k

    try:
        r = export_hf(ckpt, out, max_shard_size=10_000, strip_prefix="model.", key_map=key_map,
                      process_group=dist.group.WORLD, batch_bytes=8192)
    except Exception as e:  # noqa: BLE001 - the parent checks every rank failed
        return f"{type(e).__name__}: {e}"
    return r["written"]


def test_four_ranks_export_their_shares_of_a_four_rank_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    written = run_ranks(4, _save_and_export, ckpt, out, None)
    files = [f for w in written for f in w]
    assert len(files) == len(set(files)) and all(written)  # every rank wrote, no file twice
    assert sorted(files + [INDEX_NAME]) == sorted(os.listdir(out))
    got = _read_export(out)
    want = _full(4)
    assert set(got) == set(want)
    assert all(_same_bits(got[k], want[k]) for k in want)


def test_a_rank_that_fails_fails_every_rank_and_writes_nothing(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    outcomes = run_ranks(4, _save_and_export, ckpt, out, 2)
    assert "ValueError: no name for" in outcomes[2]
    for r in (0, 1, 3):
        assert outcomes[r].startswith("ExportError: reading the checkpoint: 1 of 4 ranks failed"), outcomes[r]
    assert not os.path.exists(out)


# ------------------------------------------------------------------ transformers


@pytest.mark.slow
def test_transformers_loads_an_exported_llama(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # saved wrapped, as a training loop holds it
    ckpt = _save_fp_dcp(tmp_path / "ckpt", {"module": model.state_dict(), "step": 1})
    out = tmp_path / "hf"
    export_hf(ckpt, out, strip_prefix="module.", max_shard_size="100KB")
    assert len(json.loads((out / INDEX_NAME).read_text())["weight_map"]) == len(want)
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    got = loaded.state_dict()
    assert set(got) == set(want)
    assert all(_same_bits(got[k], want[k]) for k in want)
