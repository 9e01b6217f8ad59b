"""The disk tier: spilled blocks as files in a directory that outlives the worker.

One directory per model and pool layout under the offload root (``<fingerprint>-<layout>``),
one file per block, named by its key (``block_file``'s format). What the directory holds is
read back at start (``scan``: headers only, no payload), so a restarted worker tells the cache
service about it in its manifest. A file whose header is not this model's and layout's, or
whose length is not what its header says, is deleted at the scan; one whose payload fails
its checksum, or that is not the block a grant expects, is deleted when it is read.

Writes go to ``<name>.tmp`` and are renamed into place (atomic on POSIX): a crash mid-write
leaves a temporary file, which the next scan deletes. A full disk (ENOSPC, EDQUOT) stops
spilling for a while (``FULL_BACKOFF_S``) and never fails a request. Thread-safe: the writer
thread writes and the load threads read while the event loop deletes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import xxhash

from worker.tier.block_file import (
    BadBlockFile,
    BlockMeta,
    Payload,
    checksum,
    decode_header,
    encode_header,
    mismatch,
)

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP = ".tmp"
FULL_BACKOFF_S = 30.0
_HEAD = 4096  # a header's usual size: its tokens and names (read again if longer)


class DiskTier:
    """Block files of one model and layout, up to ``capacity_blocks`` of them."""

    medium = "disk"

    def __init__(
        self, root: Path, fingerprint: str, layout: str, payload_len: int, capacity_blocks: int
    ) -> None:
        self.fingerprint = fingerprint
        self.layout = layout
        self.payload_len = payload_len
        self.capacity_blocks = capacity_blocks
        tag = xxhash.xxh3_64_hexdigest(f"{fingerprint}\n{layout}".encode())[:12]
        self.dir = Path(root) / f"kv-{tag}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._metas: dict[int, BlockMeta] = {}
        self.full_until = 0.0
        self.writes = self.write_failures = self.reads = self.bad_reads = 0

    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    def __contains__(self, key: int) -> bool:
        return key in self._metas

    def __len__(self) -> int:
        return len(self._metas)

    def metas(self) -> list[BlockMeta]:
        with self._lock:
            return list(self._metas.values())

    # -- start --------------------------------------------------------------------------------

    def scan(self) -> list[BlockMeta]:
        """Reads every block file's header; deletes temporary files (a crash mid-write) and
        files that are not this model's and layout's blocks, or not whole. Returns what it
        keeps, parents before children (by position)."""
        kept: dict[int, BlockMeta] = {}
        dropped = 0
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(TMP):
                _unlink(entry.path)
                dropped += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                key = int(name[: -len(SUFFIX)], 16)
                meta = self._read_meta(entry.path, entry.stat().st_size)
                if meta.key != key:
                    raise BadBlockFile(f"names block {meta.key:016x}")
            except (BadBlockFile, ValueError, OSError) as err:
                log.info("dropping %s from the disk tier: %s", name, err)
                _unlink(entry.path)
                dropped += 1
                continue
            kept[key] = meta
        with self._lock:
            self._metas = kept
        if kept or dropped:
            log.info("disk tier %s: %d blocks kept, %d files dropped", self.dir, len(kept), dropped)
        return sorted(kept.values(), key=lambda m: m.position)

    def _read_meta(self, path: str, size: int) -> BlockMeta:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
            try:
                meta, start = decode_header(head)
            except BadBlockFile:
                if len(head) < _HEAD:
                    raise
                head += f.read(1 << 20)
                meta, start = decode_header(head)
        self._check_meta(meta)
        if size != start + meta.payload_len:
            raise BadBlockFile(f"{size} bytes, its header says {start + meta.payload_len}")
        return meta

    def _check_meta(self, meta: BlockMeta) -> None:
        if meta.fingerprint != self.fingerprint:
            raise BadBlockFile("written for another model")
        if meta.layout != self.layout:
            raise BadBlockFile(f"written for another pool layout ({meta.layout})")
        if meta.payload_len != self.payload_len:
            raise BadBlockFile(f"payload of {meta.payload_len} bytes, not {self.payload_len}")

    # -- blocks -------------------------------------------------------------------------------

    def write(self, meta: BlockMeta, payload: bytes | memoryview) -> bool:
        """Writes one block (atomically: a temporary file renamed into place). False when it
        was not written: the tier is full (its capacity, or the disk: then it stops trying
        for ``FULL_BACKOFF_S``) or the write failed."""
        if time.monotonic() < self.full_until:
            return False
        with self._lock:
            if meta.key in self._metas:
                return True
            # The service evicts past the capacity as it hears of writes; never run far ahead.
            if len(self._metas) >= self.capacity_blocks + 64:
                return False
        path = self.path(meta.key)
        tmp = path.with_name(path.name + TMP)
        try:
            try:
                self._write_file(tmp, path, meta, payload)
            except FileNotFoundError:
                # The directory went away (a tmp cleaner, an operator's rm): made again.
                log.warning("disk tier %s was removed; making it again", self.dir)
                self.dir.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, path, meta, payload)
        except OSError as err:
            _unlink(tmp)
            self.write_failures += 1
            # Any failure stops spilling for a while, with one warning: a full disk, a
            # read-only or unwritable one fails every block alike (a warning each, before).
            self.full_until = time.monotonic() + FULL_BACKOFF_S
            what = (
                "is full"
                if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else ("cannot be written")
            )
            log.warning(
                "disk tier %s %s (%s): not spilling for %.0f s; requests go on",
                self.dir,
                what,
                err.strerror or err,
                FULL_BACKOFF_S,
            )
            return False
        with self._lock:
            self._metas[meta.key] = meta
        self.writes += 1
        return True

    @staticmethod
    def _write_file(tmp: Path, path: Path, meta: BlockMeta, payload: bytes | memoryview) -> None:
        with open(tmp, "wb") as f:
            f.write(encode_header(meta))
            f.write(payload)
        os.replace(tmp, path)

    def read(self, expect: BlockMeta, into: memoryview | None = None) -> Payload | None:
        """The payload of block ``expect.key``, if the file is that block, whole and intact
        (every field of ``expect`` but the checksum, which the file's payload must match).
        A file that fails is deleted; None then, and when there is none. ``into``: memory
        the file is read into where it fits (the payload is then a view of it)."""
        path = self.path(expect.key)
        data: Payload
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if into is not None and size < len(into):
                    # One byte of room past the size seen: a file grown since reads short
                    # of it and fails its checks, as a truncated one does.
                    n = 0
                    while n < len(into) and (got := f.readinto(into[n:])):
                        n += got
                    data = into[:n]
                else:
                    data = f.readall()
        except FileNotFoundError:
            self._forget(expect.key)
            return None
        except OSError as err:
            log.warning("disk tier: cannot read %s: %s", path.name, err)
            return None
        self.reads += 1
        try:
            meta, start = decode_header(data)
            self._check_meta(meta)
            if (field := mismatch(meta, expect)) is not None:
                raise BadBlockFile(f"holds another block (its {field} differs)")
            payload = memoryview(data)[start:]  # no copy of 1+ MB a block
            if len(payload) != meta.payload_len:
                raise BadBlockFile(
                    f"{len(payload)} payload bytes, its header says {meta.payload_len}"
                )
            if checksum(payload) != meta.checksum:
                raise BadBlockFile("payload checksum mismatch")
        except BadBlockFile as err:
            self.bad_reads += 1
            log.warning("disk tier: dropping %s: %s", path.name, err)
            self.delete([expect.key])
            return None
        return payload

    def delete(self, keys: list[int]) -> None:
        for key in keys:
            self._forget(key)
            _unlink(str(self.path(key)))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._metas.pop(key, None)


def _unlink(path: str | Path) -> None:
    """Deletes ``path`` if it can: a file already gone, or a tier that became read-only, is
    no error of the caller's (a failed write's clean-up raised again and was logged as a
    bug, twice a block)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.debug("disk tier: cannot delete %s: %s", path, err)
