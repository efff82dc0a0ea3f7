"""The stores of the prefix cache's second tier (scheduler/cache_tier.py): host RAM and disk.

An entry is a holder's tokens and K/V rows as stored (kvcache/cell_file.py's CellFile). The RAM
store keeps the copied tensors; the disk store writes cell files named `<key>.cells` from one
writer thread with a bounded queue (a full queue drops the save: tier traffic never blocks a
step) and reads them on a reader thread. Files are written atomically and checksummed, and
carry the model's fingerprint: a restarted server indexes only its own model's whole files; a
torn or damaged one is deleted when read, never restored.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.cell_file import (
    MAGIC,
    CellFile,
    CellFileError,
    copy_out,
    read_cell_file,
    write_back,
    write_cell_file,
)
from kvcache.tier_entry import StoredEntry

log = logging.getLogger(__name__)

SUFFIX = ".cells"


def _nbytes(data: CellFile) -> int:
    rows = sum(g.k.nbytes + g.v.nbytes + g.positions.nbytes for g in data.groups)
    return rows + data.tokens.nbytes


class RamStore:
    """Entries as tensors in this process (`--cache-ram MiB`)."""

    name = "ram"

    def __init__(self, max_bytes: int, model: str) -> None:
        self.max_bytes = max_bytes
        self.model = model
        self._data: dict[str, CellFile] = {}

    def entries(self) -> list[StoredEntry]:
        return []

    def put(self, key: str, held: Any, worker: Any) -> int:
        data = copy_out(self.model, held, worker)
        self._data[key] = data
        return _nbytes(data)

    def get(self, key: str) -> Future[Any]:
        future: Future[Any] = Future()
        data = self._data.get(key)
        if data is None:
            future.set_exception(KeyError(key))
        else:
            future.set_result(data)
        return future

    def write(self, entry: Any, cells: list[np.ndarray], worker: Any) -> None:
        write_back(entry, cells, worker)  # CellFileError is a ValueError

    def drop(self, key: str) -> None:
        self._data.pop(key, None)


class DiskStore:
    """Entries as cell files in `folder` (`--cache-dir DIR`, at most `max_bytes`)."""

    name = "disk"

    def __init__(self, folder: str | Path, max_bytes: int, model: str, queue_size: int = 8) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.model = model
        self._queue: queue.Queue[tuple[str, CellFile] | None] = queue.Queue(queue_size)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cellserve-tier-read")
        self._writer = threading.Thread(target=self._write_loop, name="cellserve-tier-write")
        self._writer.daemon = True
        self._writer.start()
        self._dropped: set[str] = set()
        self._written: dict[str, threading.Event] = {}  # queued writes: set once on disk
        self._lock = threading.Lock()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def entries(self) -> list[StoredEntry]:
        """This model's files, oldest first, from their headers and tokens (not verified
        until read)."""
        out: list[StoredEntry] = []
        for path in sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            try:
                peeked = _peek_tokens(path, self.model)
            except (OSError, ValueError, TypeError):
                continue
            if peeked is not None:
                tokens, lora, lora_name = peeked
                out.append(StoredEntry(path.stem, tokens, path.stat().st_size, lora, lora_name))
        return out

    def put(self, key: str, held: Any, worker: Any) -> int:
        if self._queue.full():
            return -1
        data = copy_out(self.model, held, worker)
        with self._lock:
            self._dropped.discard(key)
            self._written[key] = threading.Event()
        try:
            self._queue.put_nowait((key, data))
        except queue.Full:
            with self._lock:
                self._written.pop(key).set()
            return -1
        return _nbytes(data)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, data = item
            with self._lock:
                skip = key in self._dropped
            try:
                if not skip:
                    write_cell_file(self.path(key), data)
            except OSError:
                log.exception("cache tier disk: could not write %s", self.path(key))
            with self._lock:
                if key in self._dropped:  # dropped while it was being written
                    self.path(key).unlink(missing_ok=True)
                done = self._written.pop(key, None)
            if done is not None:
                done.set()

    def get(self, key: str) -> Future[Any]:
        with self._lock:
            pending = self._written.get(key)

        def read() -> CellFile:
            if pending is not None:  # a queued write: read the file once it is whole
                pending.wait(60)
            path = self.path(key)
            try:
                return read_cell_file(path, self.model)[0]
            except CellFileError:
                path.unlink(missing_ok=True)
                raise

        return self._reader.submit(read)

    def write(self, entry: Any, cells: list[np.ndarray], worker: Any) -> None:
        write_back(entry, cells, worker)  # CellFileError is a ValueError

    def drop(self, key: str) -> None:
        with self._lock:
            self._dropped.add(key)
        self.path(key).unlink(missing_ok=True)

    def close(self) -> None:
        """Finish the queued writes (a drained shutdown keeps them)."""
        self._queue.put(None)
        self._writer.join(timeout=60)
        self._reader.shutdown(wait=True)


def _peek_tokens(path: Path, model: str) -> tuple[np.ndarray, Any, str | None] | None:
    """The tokens, LoRA key and LoRA name of a cell file of `model` (None: another model's),
    reading only its header and token bytes."""
    with path.open("rb") as f:
        head = f.read(len(MAGIC) + 8)
        if head[: len(MAGIC)] != MAGIC or len(head) < len(MAGIC) + 8:
            raise ValueError("not a cell file")
        (n_header,) = struct.unpack_from("<Q", head, len(MAGIC))
        header = json.loads(f.read(n_header))
        if header.get("model") != model:
            return None
        n = int(header["n_tokens"])
        raw = f.read(8 * n)
        if len(raw) != 8 * n:
            raise ValueError("truncated")
        lora = tuple((int(i), float(s)) for i, s in header.get("lora", []))
        return np.frombuffer(raw, dtype=np.int64).copy(), lora, header.get("lora_name")
