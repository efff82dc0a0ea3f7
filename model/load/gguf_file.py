"""A GGUF file (llama.cpp's format), memory-mapped: metadata as plain Python values, tensors as
numpy views of the mapping.

The `gguf` package's GGUFReader builds a numpy object per metadata entry and per array element
(Qwen's vocabulary is 151,936 strings, Gemma's 262,144: seconds of start-up); this reads the
header once with struct and keeps nothing but the decoded values. Tensor data is never read
here: `GGUFTensor.data` is a view of the read-only mapping, so the pages a model does not touch
stay on disk and the ones it does are shared with the page cache (a second process, or a second
start, maps the same pages). The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands, or is truncated."""


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (ne[0])
    tensor_type: GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray  # float types: their values [..., ne1, ne0]; block types: uint8 rows

    @property
    def type_id(self) -> int:
        return int(self.tensor_type)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.n_bytes // self.n_rows

    def rows(self) -> np.ndarray:
        """The raw bytes as [rows, row_bytes] uint8 (a view of the mapping)."""
        return self.data.view(np.uint8).reshape(self.n_rows, self.row_bytes)


class GGUFFile:
    """`fields`: every metadata key -> its value (str, int, float, bool, or a list of them);
    `tensors`: in file order; `tensor(name)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFError(f"cannot map the file ({e})") from e
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        self.fields: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except struct.error as e:
            raise GGUFError(f"the header ends early ({e})") from e
        self._by_name = {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> GGUFTensor | None:
        return self._by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
        (self.version,) = struct.unpack_from("<I", buf, 4)
        if self.version not in (2, 3):
            raise GGUFError(f"GGUF version {self.version} (this reader takes 2 and 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.fields[key], pos = self._value(vtype, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(n) for n in shape), ttype, offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-pos // alignment) * alignment
        for name, shape, ttype, offset in infos:
            self.tensors.append(self._tensor(name, shape, ttype, data_start + offset))

    def _tensor(self, name: str, shape: tuple[int, ...], ttype: int, start: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise GGUFError(f"tensor {name}: unknown ggml type {ttype}") from e
        n = int(np.prod(shape, dtype=np.int64))
        if shape[0] % block:
            raise GGUFError(f"tensor {name}: row of {shape[0]} is not whole {block}-blocks")
        n_bytes = n // block * type_size
        if start + n_bytes > len(self.buffer):
            raise GGUFError(f"tensor {name} runs past the end of the file (truncated)")
        raw = self.buffer[start : start + n_bytes]
        dims = tuple(reversed(shape))
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(dims)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(dims)
        else:  # block types and BF16 as their bytes, one row per line
            data = raw.reshape(*dims[:-1], dims[-1] // block * type_size)
        return GGUFTensor(name, shape, qtype, start, n_bytes, data)

    def _string(self, pos: int) -> tuple[str, int]:
        items, pos = self._strings(1, pos)
        return items[0], pos

    def _strings(self, count: int, pos: int) -> tuple[list[str], int]:
        """An array of strings (a vocabulary, its merges: 150k-260k of them) in one tight loop."""
        buf, size, unpack = self._map, len(self._map), _U64.unpack_from
        items = []
        append = items.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8 + n
            if pos > size:
                raise struct.error("string past the end")
            append(buf[pos - n : pos].decode("utf-8", errors="replace"))
        return items, pos

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(pos)
        if vtype in _SCALARS:
            fmt, _ = _SCALARS[vtype]
            (value,) = struct.unpack_from(fmt, self._map, pos)
            return (bool(value) if vtype == _BOOL else value), pos + struct.calcsize(fmt)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                end = pos + count * dtype.itemsize
                if end > len(self._map):
                    raise struct.error("array past the end")
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=pos)
                out = values.astype(bool).tolist() if etype == _BOOL else values.tolist()
                return out, end
            if etype == _STRING:
                return self._strings(count, pos)
            items = []
            for _ in range(count):
                item, pos = self._value(etype, pos)
                items.append(item)
            return items, pos
        raise GGUFError(f"unknown metadata value type {vtype}")


# Start-up asks one file several questions (an encoder? its weights' type? blocks this CPU
# serves? then the load): the header is parsed once (a 151,936-token vocabulary is ~0.3 s) and
# the same read-only GGUFFile answers them all. Keyed by the file's identity and mtime, so a
# file rewritten in place is read again; a few entries, so mappings of old files do not pile up.
_OPENED: OrderedDict[tuple[object, ...], GGUFFile] = OrderedDict()
_OPENED_MAX = 4
_OPENED_LOCK = threading.Lock()  # adapters load from request handlers' threads too


def open_shared(path: str | Path) -> GGUFFile:
    """The GGUFFile of `path`, parsed once while the file is unchanged."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _OPENED_LOCK:
        reader = _OPENED.pop(key, None) or GGUFFile(path)
        _OPENED[key] = reader
        while len(_OPENED) > _OPENED_MAX:
            _OPENED.popitem(last=False)
    return reader
