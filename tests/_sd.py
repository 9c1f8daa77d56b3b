"""Generated state dicts and bit-exact comparison, shared by the tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

# DCP wraps a rank's exception in CheckpointException (a BaseException) whose
# text carries the original message and traceback.
FAILED = (Exception, CheckpointException)

# Every dtype DCP can save (torch.save can serialize), bool and complex included.
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def random_tensor(shape, dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` (NaN payloads included: compare with bits_equal)."""
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8).astype(bool)).reshape(shape)
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, n * esize, dtype=np.uint8))
    return raw.view(dtype).reshape(shape).clone()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    # clone(contiguous_format): a one-element tensor with any stride counts as
    # contiguous, and then reshape(-1) keeps that stride, which view() refuses
    return torch.equal(a.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8),
                       b.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8))


def assert_sd_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert bits_equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_sd_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_sd_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def zeros_like_sd(sd: Any) -> Any:
    """A target of the same structure: fresh zeroed tensors, non-tensors kept."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd, memory_format=torch.contiguous_format)
    if isinstance(sd, dict):
        return {k: zeros_like_sd(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_sd(v) for v in sd]
    return None if not isinstance(sd, (int, float, str, bytes)) else type(sd)()


def mixed_state_dict(seed: int = 0) -> dict[str, Any]:
    """Every dtype and shape class: 0-d, empty, non-contiguous, views sharing
    storage, nested dicts and lists, non-tensor items."""
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {}
    for i, dt in enumerate(DTYPES):
        sd[f"d{i}_{str(dt)[6:]}"] = random_tensor((3, 5, 7), dt, rng)
    base = random_tensor((64, 48), torch.float32, rng)
    sd["scalar"] = random_tensor((), torch.bfloat16, rng)
    sd["empty"] = random_tensor((0, 4), torch.float32, rng)
    sd["empty1d"] = random_tensor((0,), torch.int64, rng)
    sd["transposed"] = base.t()
    sd["strided"] = base[::3, 1::2]
    sd["view_a"] = base[:32]
    sd["view_b"] = base[16:]
    sd["big"] = random_tensor((1024, 1100), torch.float32, rng)  # > pack threshold, unaligned size
    sd["nested"] = {
        "layer": {"w": random_tensor((17, 3), torch.float16, rng), "b": random_tensor((17,), torch.float16, rng)},
        "list": [random_tensor((5,), torch.int32, rng), random_tensor((2, 2), torch.complex64, rng)],
    }
    sd["step"] = 1234
    sd["lr"] = 0.5
    sd["name"] = "model-α"
    sd["config"] = {"layers": [1, 2, 3], "act": "gelu"}
    return sd


# ------------------------------------------------ save / load with a closed writer


def root_error(exc: BaseException) -> BaseException:
    """The exception a rank raised, out of DCP's CheckpointException."""
    if isinstance(exc, CheckpointException):
        (first, _), *_ = exc.failures.values()
        return first
    return exc


def save(sd, path, **options) -> None:
    """dcp.save through a FastPersistWriter(path, **options), closed after."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    w = FastPersistWriter(path, **options)
    try:
        dcp.save(sd, storage_writer=w)
    finally:
        w.close()


def load(sd, path, **options):
    """dcp.load through a FastPersistReader(path, **options), closed after;
    returns the reader (its ``last_stats``)."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    r = FastPersistReader(path, **options)
    try:
        dcp.load(sd, storage_reader=r)
    finally:
        r.close()
    return r


def failed_save(sd, path, **options) -> BaseException:
    """The error a save must raise (out of DCP's wrapper); AssertionError if it succeeds."""
    try:
        save(sd, path, **options)
    except FAILED as e:
        return root_error(e)
    raise AssertionError(f"the save into {path} succeeded")


def failed_load(sd, path, **options) -> BaseException:
    """The error a load must raise (out of DCP's wrapper); AssertionError if it succeeds."""
    try:
        load(sd, path, **options)
    except FAILED as e:
        return root_error(e)
    raise AssertionError(f"the load of {path} succeeded")


def flip_byte(path, offset: int, mask: int = 0x40) -> None:
    """Damage one byte of a file in place (XOR ``mask``): the checksum tests' corruption."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def metadata_doc_v2(path) -> dict:
    """The JSON document of the metadata of the checkpoint at ``path`` in
    format version 2 (per-item sections), the metadata file rewritten so:
    the tests that edit those sections item by item edit a version-2 body."""
    import json
    import os

    from fp_dcp import format as fmt

    meta = os.path.join(path, fmt.METADATA_NAME)
    with open(meta, "rb") as f:
        metadata, layout, extra = fmt.decode_metadata(f.read(), meta)
    blob = fmt.encode_metadata(metadata, layout, extra, version=2)
    with open(meta, "wb") as f:
        f.write(blob)
    return json.loads(blob[fmt.HEADER_SIZE:])


def write_metadata_doc(path, doc: dict, version: int = 2) -> None:
    """Write ``doc`` as the metadata of the checkpoint at ``path`` (header of ``version``)."""
    import json
    import os
    import struct
    import zlib

    from fp_dcp import format as fmt

    body = json.dumps(doc).encode()
    with open(os.path.join(path, fmt.METADATA_NAME), "wb") as f:
        f.write(struct.pack("<8sIIQ", b"FPDCP\x00\r\n", version, zlib.crc32(body), len(body)) + body)
