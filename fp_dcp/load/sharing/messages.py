"""Short texts between the ranks of a shared read, as fixed ``uint8`` rows of
``MESSAGE_ROW_BYTES`` (flag, ``uint32`` length, at most ``MESSAGE_TEXT_BYTES``
of UTF-8), never pickled; a malformed row is a :class:`PeerMessageError`."""

from __future__ import annotations

import struct
from typing import Any

import torch

__all__ = ["MESSAGE_ROW_BYTES", "MESSAGE_TEXT_BYTES", "PeerMessageError", "encode_text", "decode_text",
           "gather_texts"]

MESSAGE_TEXT_BYTES = 4096
_HEAD = struct.Struct("<BI")
MESSAGE_ROW_BYTES = _HEAD.size + MESSAGE_TEXT_BYTES


class PeerMessageError(RuntimeError):
    """A message from another rank that is not a well-formed text row."""


def encode_text(text: str | None) -> bytes:
    """``text`` (None: no message) as one row of ``MESSAGE_ROW_BYTES``."""
    if text is None:
        return bytes(MESSAGE_ROW_BYTES)
    data = text.encode("utf-8", "replace")[:MESSAGE_TEXT_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _HEAD.pack(1, len(data)) + data + bytes(MESSAGE_TEXT_BYTES - len(data))


def decode_text(row: bytes, rank: int) -> str | None:
    """The text a row from ``rank`` carries, or None; a malformed row is a
    :class:`PeerMessageError` naming the rank and what is wrong."""
    if len(row) != MESSAGE_ROW_BYTES:
        raise PeerMessageError(f"rank {rank} sent a message of {len(row)} bytes, not {MESSAGE_ROW_BYTES}")
    flag, length = _HEAD.unpack_from(row)
    if flag == 0 and length == 0:
        return None
    if flag != 1 or length > MESSAGE_TEXT_BYTES:
        raise PeerMessageError(f"rank {rank} sent a malformed message (flag {flag}, length {length})")
    try:
        return row[_HEAD.size:_HEAD.size + length].decode("utf-8")
    except UnicodeDecodeError as e:
        raise PeerMessageError(f"rank {rank} sent a message that is not UTF-8 text ({e.reason})") from None


def gather_texts(text: str | None, group: Any, world: int, device: Any) -> list[str | None]:
    """Every rank's ``text`` (None where a rank has none), by rank: one
    ``all_gather`` of fixed-size byte rows over ``group`` on ``device``."""
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(encode_text(text)), dtype=torch.uint8).to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [decode_text(row.cpu().numpy().tobytes(), r) for r, row in enumerate(rows)]
