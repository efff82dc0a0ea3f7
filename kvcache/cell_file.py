"""Cell files: one sequence's cached tokens and K/V rows on disk (slot save/restore), or in a
recurrent layer group its state after the last token (its conv and ssm values as the K and V
"rows" of one position: kvcache/state_storage.py read_cells).

Layout: MAGIC | u64 little-endian header length | header (JSON) | payload. The header names
the model (model.load.fingerprint, which covers the LoRA adapter files too), the tokens, the
LoRA adapters they were computed under (ids and scales), each layer group's geometry, the dtype
and length of its K and V rows and the positions it keeps (a sliding-window group keeps only
the last window), and the payload's SHA-256. The payload is the tokens (int64) and then, per
group, K and V as stored: [n_layers, n_kv_heads, n_rows, row] (a float type's row is head_dim
values; a quantized cache type's, --cache-type-k/-v q8_0 / q4_0, its blocks' bytes as uint8).
A file whose magic, model, geometry, length or checksum does not match is refused, never
restored. A write goes to a temporary file in the same directory, is fsync'd and renamed over
the target: a crash leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAGIC = b"CELLKV02"  # 02: K and V rows described apart (quantized cache types)


class CellFileError(ValueError):
    """A cell file that cannot be restored here (the message says why)."""


@dataclass(slots=True)
class GroupRows:
    """One layer group's rows of a sequence: K and V [n_layers, n_kv_heads, n_rows, row] as
    stored, for the sorted `positions` [n_rows] the group keeps."""

    positions: np.ndarray
    k: torch.Tensor
    v: torch.Tensor
    # how the storage conditioned them (kvcache/rotation.py): rot_k, rot_v, K centred
    rotation: tuple[int, int, bool] = (0, 0, False)

    def geometry(self) -> dict[str, object]:
        return rows_geometry(self.k, self.v, *self.rotation)


def rows_geometry(
    k: torch.Tensor, v: torch.Tensor, rot_k: int = 0, rot_v: int = 0, k_centered: bool = False
) -> dict[str, object]:
    """What K and V rows [n_layers, n_kv_heads, n, row] look like, whatever n (a storage's
    whole tensors or one sequence's rows): a restore needs the same on both sides. A rotated
    quantized type (kvcache/rotation.py) adds its n as k_rot / v_rot: the same bytes unrotated
    are other values, so a file from a server without the rotation is refused, not restored;
    likewise K rows stored less a constant (k_centered: kvcache/rotation.py k_center)."""
    n_layers, n_kv_heads = k.shape[:2]
    geometry: dict[str, object] = {
        "n_layers": int(n_layers),
        "n_kv_heads": int(n_kv_heads),
        "k_row": int(k.shape[-1]),
        "k_dtype": str(k.dtype).removeprefix("torch."),
        "v_row": int(v.shape[-1]),
        "v_dtype": str(v.dtype).removeprefix("torch."),
    }
    if rot_k:
        geometry["k_rot"] = int(rot_k)
    if rot_v:
        geometry["v_rot"] = int(rot_v)
    if k_centered:
        geometry["k_centered"] = True
    return geometry


def geometry_rotation(geometry: dict[str, Any]) -> tuple[int, int, bool]:
    """The (rot_k, rot_v, k_centered) that rows_geometry recorded in `geometry`."""
    g = geometry
    return int(g.get("k_rot", 0)), int(g.get("v_rot", 0)), g.get("k_centered") is True


@dataclass(slots=True)
class CellFile:
    model: str  # the model's fingerprint
    tokens: np.ndarray  # [n] int64 at positions 0..n-1
    groups: list[GroupRows]
    lora: tuple[tuple[int, float], ...] = ()  # scheduler.plan.LoraKey: (adapter id, scale)
    lora_name: str | None = None  # the name KV events give those adapters


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write_cell_file(path: Path, data: CellFile) -> int:
    """Write `data` to `path` atomically; -> bytes written."""
    parts = [np.ascontiguousarray(data.tokens, dtype=np.int64).tobytes()]
    groups = []
    for g in data.groups:
        parts += [np.ascontiguousarray(g.positions, dtype=np.int64).tobytes(), _raw(g.k), _raw(g.v)]
        groups.append({**g.geometry(), "n_rows": int(g.positions.shape[0])})
    payload = b"".join(parts)
    header = json.dumps(
        {
            "model": data.model,
            "n_tokens": int(data.tokens.shape[0]),
            "lora": [[int(i), float(s)] for i, s in data.lora],
            "lora_name": data.lora_name,
            "groups": groups,
            "payload_bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(MAGIC) + 8 + len(header) + len(payload)


def read_cell_file(path: Path, model: str) -> tuple[CellFile, int]:
    """-> (the file's content, bytes read); CellFileError if it is not a whole cell file of
    `model` (the caller checks the geometry against its own cache)."""
    raw = path.read_bytes()
    if raw[: len(MAGIC) - 2] == MAGIC[:-2] and raw[: len(MAGIC)] != MAGIC:
        raise CellFileError("it is an older cell file format: save the slot again")
    if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 8:
        raise CellFileError("not a cellserve slot file")
    (n_header,) = struct.unpack_from("<Q", raw, len(MAGIC))
    start = len(MAGIC) + 8 + n_header
    try:
        header = json.loads(raw[len(MAGIC) + 8 : start])
        n_tokens = int(header["n_tokens"])
        groups = header["groups"]
        expected = int(header["payload_bytes"])
        lora = tuple((int(i), float(s)) for i, s in header.get("lora", []))
        lora_name = header.get("lora_name")
    except (ValueError, KeyError, TypeError) as e:
        raise CellFileError(f"its header is damaged ({e})") from e
    payload = raw[start:]
    if len(payload) != expected or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CellFileError("it is truncated or damaged (checksum mismatch)")
    if header["model"] != model:
        raise CellFileError("it was saved from a different model")
    buf = memoryview(payload)
    at = 8 * n_tokens
    tokens = np.frombuffer(buf[:at], dtype=np.int64).copy()
    rows = []
    try:
        for g in groups:
            n = int(g["n_rows"])
            positions = np.frombuffer(buf[at : at + 8 * n], dtype=np.int64).copy()
            at += 8 * n
            kv = []
            for part in ("k", "v"):
                dtype = getattr(torch, str(g[f"{part}_dtype"]), None)
                if not isinstance(dtype, torch.dtype):
                    raise CellFileError(f"unknown dtype {g[f'{part}_dtype']!r}")
                shape = (int(g["n_layers"]), int(g["n_kv_heads"]), n, int(g[f"{part}_row"]))
                size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
                if at + size > len(buf):
                    raise CellFileError("its header does not match its payload")
                if size == 0:
                    kv.append(torch.empty(shape, dtype=dtype))
                    continue
                chunk = torch.frombuffer(bytearray(buf[at : at + size]), dtype=torch.uint8)
                kv.append(chunk.view(dtype).reshape(shape))
                at += size
            rows.append(GroupRows(positions, kv[0], kv[1], geometry_rotation(g)))
    except CellFileError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise CellFileError(f"its header is damaged ({e})") from e
    return CellFile(header["model"], tokens, rows, lora, lora_name), len(raw)


def check_geometry(groups: list[GroupRows], geometry: list[dict[str, object]]) -> None:
    """CellFileError unless the rows fit a storage of `geometry` (the worker's kv_geometry)."""
    saved = [g.geometry() for g in groups]
    if saved != geometry:
        raise CellFileError(
            f"its cache layout {saved} does not match this server's {geometry} "
            "(another model, --dtype or --cache-type-k / --cache-type-v)"
        )


def check_last_rows(data: CellFile) -> None:
    """CellFileError unless every layer group holds the row of the last position, which every
    memory keeps (full attention, a window, a recurrent state): checked before a restore
    touches the cache; place_rows checks the rest once the cells are placed."""
    n = int(data.tokens.shape[0])
    for i, g in enumerate(data.groups):
        if g.positions.size == 0 or int(g.positions[-1]) != n - 1:
            raise CellFileError(f"layer group {i} lacks the rows of its last position ({n - 1})")


def place_rows(
    groups: list[GroupRows], cells: list[np.ndarray]
) -> tuple[list[np.ndarray], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`cells`: per group, the cell of each position 0..n-1 (-1 where the group no longer
    keeps it: a sliding window's old rows; a recurrent group keeps only the last one, its
    state) -> per group, the cells and the rows to write there (worker.write_rows).
    CellFileError where the file lacks a row the cache keeps (nothing is written): a cell
    left unwritten would hold another sequence's rows, a recurrent slot a zero state."""
    out_cells, out_rows = [], []
    for i, (g, at_pos) in enumerate(zip(groups, cells, strict=True)):
        n = at_pos.shape[0]
        if g.positions.size and (g.positions.min() < 0 or g.positions.max() >= n):
            raise CellFileError(f"layer group {i} has rows outside its {n} tokens")
        missing = np.setdiff1d(np.flatnonzero(at_pos >= 0), g.positions)
        if missing.size:
            raise CellFileError(
                f"layer group {i} lacks the rows of {missing.size} positions the cache keeps "
                f"(first: {int(missing[0])})"
            )
        at = at_pos[g.positions]
        keep = at >= 0
        index = torch.from_numpy(np.flatnonzero(keep))
        out_cells.append(at[keep])
        out_rows.append((g.k.index_select(2, index), g.v.index_select(2, index)))
    return out_cells, out_rows


def copy_out(model: str, held: Any, worker: Any) -> CellFile:
    """A held prefix as a cell file holds it: `held` (scheduler/saved_slots.py SlotCells: its
    tokens, per group the cells and their positions, its LoRA adapters) with its K/V rows read
    out of the worker's storage; `model` the model's fingerprint."""
    rows = worker.read_rows(held.cells)
    rotations = [geometry_rotation(g) for g in worker.kv_geometry()]
    groups = [
        GroupRows(p.copy(), k, v, r)
        for p, (k, v), r in zip(held.positions, rows, rotations, strict=True)
    ]
    return CellFile(model, held.tokens.copy(), groups, held.lora, held.lora_name)


def write_back(data: CellFile, cells: list[np.ndarray], worker: Any) -> None:
    """`data`'s rows into the worker's storage (`cells`: as place_rows takes them);
    CellFileError where the rows' layout is not the storage's (check_geometry) or the file
    lacks rows the cache keeps (place_rows)."""
    check_geometry(data.groups, worker.kv_geometry())
    worker.write_rows(*place_rows(data.groups, cells))
