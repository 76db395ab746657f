"""Read the records of a W&B run file (`run-<id>.wandb`) without a server, e.g. an offline run.

The file is W&B's append-only log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
chunks, each chunk `crc32c (4) | length (2, little endian) | type (1: full, 2: first, 3: middle, 4: last)`
followed by its bytes; a complete record is one protobuf `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_HEADER = 7
_BLOCK = 32768
_CHUNK_HEADER = 7


def iter_records(path: str | Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - (pos % _BLOCK)
        if left_in_block < _CHUNK_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        pos += _CHUNK_HEADER
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += _BLOCK - (pos % _BLOCK) if pos % _BLOCK else 0
            continue
        chunk = data[pos:pos + length]
        pos += length
        if kind == 1:
            pending = b""
            payload = chunk
        elif kind == 2:
            pending = chunk
            continue
        elif kind == 3:
            pending += chunk
            continue
        elif kind == 4:
            payload, pending = pending + chunk, b""
        else:
            raise ValueError(f"{path}: corrupt chunk type {kind} at byte {pos}")
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        yield rec


def history(path: str | Path) -> list:
    """The logged rows (`wandb.log` calls) as dicts of key -> decoded JSON value."""
    rows = []
    for rec in iter_records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def find_run_files(run_dir: str | Path) -> list:
    return sorted(Path(run_dir).glob("wandb/*run-*/run-*.wandb"))
