"""Moving data files between ranks over the tiers' own process group.

A *transfer* is one data file (``name``, ``size``) from the rank that holds
it (``src``) to the rank that needs it (``dst``).  Every rank computes the
same list in the same order and runs the transfers it takes part in, in
that order, each to completion before the next: with blocking pairs in one
global order no rank waits on a rank that waits on it (the first
unfinished transfer always has both ends at it).  Files travel as uint8
tensors in chunks of ``chunk_bytes``.

Transports:

* gloo (CPU): the bytes are CPU tensors (``numpy`` views of the file, no
  copy beyond the read).  Tested.
* NCCL (GPU): the same chunks are copied to a ``torch.cuda.current_device()``
  uint8 tensor, sent, and copied back to host memory on the receiver.
  Written for GPU clusters (where gloo would cross the slow host network
  stack), tested only where CUDA and several GPUs exist
  (``tests/test_tiers.py`` skips otherwise).

The receiver checks every received file against the checksums of its
metadata (:mod:`fp_dcp.tiers.integrity`) before it names it: a file that
arrived damaged is never taken for a replica.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Transfer", "run_transfers", "group_device"]

CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    name: str
    size: int


def group_device(group) -> torch.device:
    """Where the tensors of ``group``'s point-to-point calls live."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_transfers(
    transfers: list[Transfer],
    rank: int,
    group,
    read: Callable[[Transfer], np.ndarray],
    receive: Callable[[Transfer, np.ndarray], None],
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[dict[str, int], dict[Transfer, str]]:
    """Run this rank's part of ``transfers`` (a list every rank holds alike):
    ``read(t)`` gives the bytes of a file this rank sends, ``receive(t,
    data)`` takes the bytes of one it received.  ``src``/``dst`` are ranks
    of ``group``.  Returns the bytes sent and received, and the transfers
    of this rank that failed with why (an error of ``read`` on the sender
    is announced to the receiver first, so both go on to the next
    transfer: one bad file never stalls the others)."""
    device = group_device(group)
    sent = received = 0
    failed: dict[Transfer, str] = {}

    def to_wire(t: torch.Tensor) -> torch.Tensor:
        return t if device.type == "cpu" else t.to(device)

    for t in transfers:
        if t.src == t.dst or rank not in (t.src, t.dst):
            continue
        if rank == t.src:
            try:
                data = read(t)
                if data.size < t.size:
                    raise OSError(f"{t.name}: {data.size} bytes, {t.size} expected")
            except Exception as e:  # noqa: BLE001 - reported to the receiver and the caller
                failed[t] = f"rank {rank} could not read it: {e}"
                dist.send(to_wire(torch.ones(1, dtype=torch.int64)), group_dst=t.dst, group=group)
                continue
            dist.send(to_wire(torch.zeros(1, dtype=torch.int64)), group_dst=t.dst, group=group)
            for start in range(0, t.size, chunk_bytes):
                dist.send(to_wire(torch.from_numpy(data[start: start + chunk_bytes])), group_dst=t.dst, group=group)
            sent += t.size
        else:
            status = to_wire(torch.zeros(1, dtype=torch.int64))
            dist.recv(status, group_src=t.src, group=group)
            if int(status.item()):
                failed[t] = f"rank {t.src} could not read it"
                continue
            data = np.empty(t.size, dtype=np.uint8)
            for start in range(0, t.size, chunk_bytes):
                n = min(chunk_bytes, t.size - start)
                if device.type == "cpu":
                    dist.recv(torch.from_numpy(data[start: start + n]), group_src=t.src, group=group)
                else:
                    chunk = torch.empty(n, dtype=torch.uint8, device=device)
                    dist.recv(chunk, group_src=t.src, group=group)
                    data[start: start + n] = chunk.cpu().numpy()
            received += t.size
            try:
                receive(t, data)
            except Exception as e:  # noqa: BLE001 - the caller decides (next tier)
                failed[t] = str(e)
    return {"sent_bytes": sent, "received_bytes": received}, failed
