"""The model fingerprint (kvserve_model/fingerprint.py): every weight byte counts, and a start
after the first takes each file's digest from the per-user cache instead of reading it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvserve_model.fingerprint import hash_file, model_fingerprint
from kvserve_model.tiny_model import write_tiny_model


class CountingHash:
    """``hash_file``, counting the files and bytes it reads."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.bytes = 0

    def __call__(self, file: Path) -> bytes:
        self.files.append(file)
        self.bytes += file.stat().st_size
        return hash_file(file)


def rewrite_middle(file: Path, n: int = 4) -> None:
    """Flips ``n`` bytes in the middle of ``file``'s data, in place: same size, same header
    (a layer's weights changed, as a fine-tune written over the checkpoint would)."""
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.seek(size // 2)
        old = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in old))
    assert file.stat().st_size == size


def test_a_few_weight_bytes_in_the_middle_change_the_fingerprint(tmp_path: Path) -> None:
    """Two model directories identical but for 4 bytes in the middle of the weights (same
    size, same header, far from the first and last MiB the fingerprint once sampled) get
    different fingerprints; the same directory, fingerprinted again, the same one, its weights
    read once."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    write_tiny_model(a)
    write_tiny_model(b)
    count = CountingHash()
    assert model_fingerprint(a, cache_dir=cache) == model_fingerprint(b, cache_dir=cache)
    rewrite_middle(b / "model.safetensors")
    fa = model_fingerprint(a, cache_dir=cache, hash_file=count)
    fb = model_fingerprint(b, cache_dir=cache, hash_file=count)
    assert fa != fb and fa.startswith("sha256:") and fb.startswith("sha256:")
    # a's digest came from the cache; b's file changed (its mtime), so it was read again.
    assert count.files == [b / "model.safetensors"]


def test_a_second_start_reads_no_weights(tmp_path: Path) -> None:
    model, cache = tmp_path / "m", tmp_path / "cache"
    write_tiny_model(model)
    first, again = CountingHash(), CountingHash()
    fingerprint = model_fingerprint(model, cache_dir=cache, hash_file=first)
    assert first.bytes == (model / "model.safetensors").stat().st_size
    assert model_fingerprint(model, cache_dir=cache, hash_file=again) == fingerprint
    assert again.files == [] and again.bytes == 0
    # Without the cache (none, or another user's): the same fingerprint, hashed.
    assert model_fingerprint(model, cache_dir=tmp_path / "other") == fingerprint


def test_a_file_rewritten_with_its_old_mtime_is_hashed_again(tmp_path: Path) -> None:
    """Size and mtime put back as they were after an in-place change: the ctime (and a copy's
    inode) still tell, so the digest is taken again and the fingerprint follows the bytes."""
    model, cache = tmp_path / "m", tmp_path / "cache"
    write_tiny_model(model)
    weights = model / "model.safetensors"
    before = model_fingerprint(model, cache_dir=cache)
    st = weights.stat()
    rewrite_middle(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    count = CountingHash()
    assert model_fingerprint(model, cache_dir=cache, hash_file=count) != before
    assert count.files == [weights]


def test_an_unreadable_or_foreign_cache_record_is_hashed_again(tmp_path: Path) -> None:
    model, cache = tmp_path / "m", tmp_path / "cache"
    write_tiny_model(model)
    fingerprint = model_fingerprint(model, cache_dir=cache)
    (record,) = cache.glob("*.json")
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({**saved, "digest": "00" * 32, "path": "/elsewhere"}))
    count = CountingHash()
    assert model_fingerprint(model, cache_dir=cache, hash_file=count) == fingerprint
    record.write_text("not json")
    assert model_fingerprint(model, cache_dir=cache, hash_file=count) == fingerprint
    assert len(count.files) == 2
