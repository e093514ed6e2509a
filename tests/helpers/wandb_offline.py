"""Reading an offline W&B run back: the records of a ``run-*.wandb`` file (a LevelDB-style log of protobuf ``Record``s:
a 7-byte header, then 32 KiB blocks of chunks, each crc32 (4) + length (2) + type (1: full, 2: first, 3: middle,
4: last)), decoded with the ``wandb`` package's own ``Record`` message."""

import json
import struct
from pathlib import Path

BLOCK, HEADER, CHUNK = 32768, 7, 7


def records(path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending, out = HEADER, b"", []
    while pos + CHUNK <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK])
        body = data[pos + CHUNK:pos + CHUNK + length]
        pos += CHUNK + length
        if kind == 0 and length == 0:
            continue
        pending = body if kind in (1, 2) else pending + body
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def finished(path, timeout_s: float = 120.0) -> Path:
    """``path`` once its run's exit record is written (W&B's service process may still be flushing the offline file
    when ``run.finish()`` returns)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if any(r.WhichOneof("record_type") == "exit" for r in records(path)):
                return Path(path)
        except Exception:  # noqa: BLE001 - a half-written file: read it again
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {timeout_s} s")
        time.sleep(0.5)


def history(path) -> list[dict]:
    """Every ``run.log`` row: {key: value} (values JSON-decoded; ``_step`` the step)."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def run_info(path) -> dict:
    """The run's project, name and config (the run record, then any later config updates)."""
    out = {"config": {}}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(project=r.run.project, name=r.run.display_name)
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else ()
        out["config"].update({item.key: json.loads(item.value_json) for item in updates})
    return out
