"""A model's fingerprint: a stable id of what a KV block computed by it depends on.

The fingerprint travels with a worker's pool registration (the cache service must never match
a prefix computed by one model against blocks of another) and is written into every disk-tier
block file (docs/kv-tiers.md): a tier file belongs to a model only while the fingerprints
agree. It hashes the config, the tokenizer (the index is keyed by token ids) and **every byte
of every weights file**: weights changed in place (same size, same header, a layer's bytes
rewritten) must not serve the KV the old weights computed. It once hashed each file's size,
header and first and last MiB only, and a disk tier outlived such a change: the restarted
worker loaded 288 stale cached tokens of a 300-token prompt and answered differently from
mlx-lm on the new weights.

Reading every byte costs a start a pass over the weights (sha256 over 8 MiB reads: 0.075 s for
the default model's 98 MB file out of the page cache on this 2-core EPYC, which has SHA
instructions; blake2b took 0.17 s; a 16 GB checkpoint would take ~12 s), so each file's digest is kept in a small per-user
cache (``kvserve_model.model_cache.user_cache_dir("weights-digests")``, one record a file)
keyed by the file's resolved path, size, mtime and ctime in nanoseconds, inode and device: a
start after the first reads no weight byte for it, and a file rewritten, replaced, touched or
copied elsewhere is hashed again. A cache that cannot be written costs the hash each start,
nothing else.

Format: ``sha256:<hex>``, as before (the service compares it as an opaque name). Tier files
written under the earlier, sampled fingerprint no longer match any model: a worker's start
deletes them as another model's (docs/kv-tiers.md, "Manifest"), and the tier fills again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from kvserve_model.context import load_config
from kvserve_model.errors import ModelLoadError
from kvserve_model.model_cache import user_cache_dir

READ_BYTES = 8 << 20
CACHE_NAME = "weights-digests"
DIGEST_VERSION = 1  # of a record's digest: a new way of hashing files changes it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def hash_file(file: Path) -> bytes:
    """sha256 of every byte of ``file``, read 8 MiB at a time into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


def _identity(file: Path) -> tuple[str, dict[str, int]]:
    """``file``'s resolved path, and what says it is unchanged since its digest was taken."""
    resolved = file.resolve()
    st = os.stat(resolved)
    stamp = {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
        "version": DIGEST_VERSION,
    }
    return str(resolved), stamp


def file_digest(
    file: Path,
    *,
    cache_dir: Path | None = None,
    hash_file: Callable[[Path], bytes] = hash_file,
) -> bytes:
    """The digest of every byte of ``file`` (``hash_file``), from the cache when its record
    matches the file's identity (``_identity``), else hashed and recorded. ``cache_dir``:
    where records are kept (the per-user cache by default)."""
    path, stamp = _identity(file)
    if cache_dir is None:
        cache_dir = user_cache_dir(CACHE_NAME)
    record = cache_dir / (hashlib.sha256(path.encode()).hexdigest()[:32] + ".json")
    try:
        saved = json.loads(record.read_text())
        if saved.get("path") == path and saved.get("stamp") == stamp:
            return bytes.fromhex(saved["digest"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # none yet, or unreadable: hash
    digest = hash_file(file)
    if _identity(file)[1] == stamp:  # not changed while it was read: worth keeping
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"path": path, "stamp": stamp, "digest": digest.hex()}))
            tmp.replace(record)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache: hashed again next start
    return digest


def model_fingerprint(
    path: Path,
    *,
    cache_dir: Path | None = None,
    hash_file: Callable[[Path], bytes] = hash_file,
) -> str:
    """A stable id of the model in ``path``: ``sha256:<hex>`` of its config, tokenizer files
    and every weights file's name and whole-content digest (:func:`file_digest`; see the
    module docstring). ``cache_dir`` and ``hash_file`` as :func:`file_digest`'s."""
    h = hashlib.sha256()
    config = load_config(path)
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for name in TOKENIZER_FILES:
        file = path / name
        if file.exists():
            h.update(name.encode() + hashlib.sha256(file.read_bytes()).digest())
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    for file in weights:
        h.update(file.name.encode())
        h.update(file_digest(file, cache_dir=cache_dir, hash_file=hash_file))
    return "sha256:" + h.hexdigest()
