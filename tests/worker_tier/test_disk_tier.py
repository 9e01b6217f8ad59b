"""The disk tier and the tier store: files that are not exactly the block expected are never
served, a crash mid-write leaves nothing that reads as a block, a full disk stops spilling
without failing anything."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from worker.tier.block_file import BlockMeta, decode_header
from worker.tier.disk import DiskTier
from worker.tier.host import HostTier
from worker.tier.store import BlockFormat, LoadArena, TierStore

BS = 4
PAYLOAD = 256


def make(root: Path, fingerprint: str = "model-a", capacity: int = 1000) -> DiskTier:
    return DiskTier(root, fingerprint, "layout-1", PAYLOAD, capacity)


def fmt_of(disk: DiskTier) -> BlockFormat:
    return BlockFormat(disk.fingerprint, disk.layout, disk.payload_len)


def store_of(disk: DiskTier, host: HostTier | None = None) -> TierStore:
    store = TierStore(BS, fmt_of(disk), disk=disk, host=host)
    store.start()
    return store


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def spill(store: TierStore, tokens: list[int], ns: str = "") -> list[BlockMeta]:
    metas = store.metas(ns, tokens, 0, len(tokens) // BS)
    new = store.to_spill(metas)
    store.enqueue(new, [payload(m.position) for m in new])
    store.flush()
    return metas


def test_blocks_written_are_found_again_after_a_restart(tmp_path: Path) -> None:
    store = store_of(make(tmp_path))
    tokens = list(range(12))
    metas = spill(store, tokens)
    stored, dropped = store.take_reports()
    assert [(m.key, md) for m, md in stored] == [(m.key, "disk") for m in metas]
    assert not dropped
    assert [m.parent_key for m in metas[1:]] == [m.key for m in metas[:-1]]
    store.close()

    again = store_of(make(tmp_path))  # a new process over the same directory
    assert sorted(m.key for m, _ in again.manifest()) == sorted(m.key for m in metas)
    assert again.load(metas) == [payload(0), payload(1), payload(2)]
    assert spill(again, tokens) and again.counters.spilled_blocks == 0  # held: not again


def test_a_namespace_or_a_different_prefix_names_other_blocks(tmp_path: Path) -> None:
    store = store_of(make(tmp_path))
    a = store.metas("", [1, 2, 3, 4, 5, 6, 7, 8], 0, 2)
    b = store.metas("tenant", [1, 2, 3, 4, 5, 6, 7, 8], 0, 2)
    c = store.metas("", [9, 2, 3, 4, 5, 6, 7, 8], 0, 2)
    assert len({a[1].key, b[1].key, c[1].key}) == 3
    assert a[1].tokens == c[1].tokens and a[1].prefix_digest != c[1].prefix_digest


def corrupt(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_payload_is_dropped_and_the_run_stops_there(tmp_path: Path) -> None:
    disk = make(tmp_path)
    store = store_of(disk)
    metas = spill(store, list(range(16)))
    store.take_reports()
    corrupt(disk.path(metas[2].key), at=-10)
    assert store.load(metas) == [payload(0), payload(1)]
    assert not disk.path(metas[2].key).exists()
    assert store.take_reports() == ([], [(metas[2].key, "disk")])
    assert store.counters.load_failures == 2  # the bad one and the one after it


def test_a_block_dropped_then_written_again_is_reported_stored_alone(tmp_path: Path) -> None:
    """A failed load drops a block; its recompute spills it again before the next report.
    The service applies a report's stored blocks before its dropped ones, so both in one
    report left it dropped there while the worker held it, and every block after it was
    refused for good (an outside probe: a third of a prompt's tier lost until a restart)."""
    disk = make(tmp_path)
    store = store_of(disk)
    metas = spill(store, list(range(16)))
    store.take_reports()
    corrupt(disk.path(metas[2].key), at=-10)
    assert len(store.load(metas)) == 2
    new = store.to_spill(metas)  # the recompute: blocks 2.. spill again
    assert [m.key for m in new] == [metas[2].key]
    store.enqueue(new, [payload(m.position) for m in new])
    store.flush()
    stored, dropped = store.take_reports()
    assert [m.key for m, _ in stored] == [metas[2].key] and dropped == []
    assert store.load(metas) == [payload(i) for i in range(4)]


def test_a_tier_directory_removed_while_running_is_made_again(tmp_path: Path) -> None:
    disk = make(tmp_path)
    store = store_of(disk)
    metas = spill(store, list(range(8)))
    shutil.rmtree(disk.dir)
    store.take_reports()
    assert store.load(metas) == []  # gone: recomputed, never served
    more = spill(store, list(range(100, 108)))
    assert disk.write_failures == 0 and disk.dir.is_dir()
    assert store.load(more) == [payload(0), payload(1)]


def test_a_tier_turned_read_only_stops_spilling_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed write's clean-up raised again on a read-only file system (a traceback per
    block, logged as a bug, and no failure counted); now the first failure backs off."""
    with small_filesystem(tmp_path / "small", "1m") as root:
        disk = DiskTier(root, "model-a", "layout-1", PAYLOAD, 1000)
        store = store_of(disk)
        metas = spill(store, list(range(8)))
        store.take_reports()
        remount = ["mount", "-o", "remount,ro", str(root)]
        if subprocess.run(remount, check=False, capture_output=True).returncode:
            pytest.skip("cannot make the file system read-only here")
        with caplog.at_level(logging.DEBUG, logger="worker.tier"):
            spill(store, list(range(200, 240)))
        assert disk.write_failures == 1 and disk.full_until > 0
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "cannot be written" in warnings[0].getMessage()
        assert store.load(metas) == [payload(0), payload(1)]  # reads go on
        store.close()


def test_truncated_foreign_and_temporary_files_are_dropped_at_the_scan(tmp_path: Path) -> None:
    disk = make(tmp_path)
    store = store_of(disk)
    metas = spill(store, list(range(16)))
    store.close()
    # Truncated: the payload's last bytes lost.
    p0 = disk.path(metas[0].key)
    p0.write_bytes(p0.read_bytes()[:-5])
    # Foreign: another model's block under a name of this directory.
    other = make(tmp_path / "other", fingerprint="model-b")
    other_store = store_of(other)
    foreign = spill(other_store, [100, 101, 102, 103])[0]
    other_store.close()
    shutil.copy(other.path(foreign.key), disk.dir / other.path(foreign.key).name)
    # A crash mid-write: a temporary file.
    (disk.dir / f"{metas[1].key:016x}.kvb.tmp").write_bytes(b"KVSBLK1\n")
    # Not a block file at all, under a block's name.
    (disk.dir / f"{12345:016x}.kvb").write_bytes(b"garbage")

    again = make(tmp_path)
    kept = {m.key for m in again.scan()}
    assert kept == {metas[1].key, metas[2].key, metas[3].key}
    assert sorted(p.name for p in again.dir.iterdir()) == sorted(again.path(k).name for k in kept)


def test_a_file_holding_another_block_under_the_expected_name_is_not_served(
    tmp_path: Path,
) -> None:
    disk = make(tmp_path)
    store = store_of(disk)
    a = spill(store, [1, 2, 3, 4])[0]
    b = store.metas("", [5, 6, 7, 8], 0, 1)[0]
    shutil.copy(disk.path(a.key), disk.path(b.key))  # the key collides, the contents do not
    assert store.load([b]) == []
    assert store.load([a]) == [payload(0)]


def test_a_block_still_queued_loads_from_the_queue(tmp_path: Path) -> None:
    disk = make(tmp_path)
    store = TierStore(BS, fmt_of(disk), disk=disk)  # not started: the writer never runs
    metas = store.metas("", list(range(8)), 0, 2)
    store.enqueue(metas, [payload(0), payload(1)])
    assert store.to_spill(metas) == []  # queued: not copied twice
    assert store.load(metas) == [payload(0), payload(1)]


def test_the_header_records_what_the_block_is(tmp_path: Path) -> None:
    disk = make(tmp_path)
    meta = spill(store_of(disk), [7, 8, 9, 10], ns="t")[0]
    header, start = decode_header(disk.path(meta.key).read_bytes())
    assert (header.namespace, header.tokens, header.position) == ("t", (7, 8, 9, 10), 0)
    assert (
        header.payload_len == PAYLOAD and len(disk.path(meta.key).read_bytes()) == start + PAYLOAD
    )


def test_a_backlog_past_its_bound_skips_spills_instead_of_growing(tmp_path: Path) -> None:
    disk = make(tmp_path)  # the writer not started
    store = TierStore(BS, fmt_of(disk), disk=disk, max_backlog_bytes=2 * PAYLOAD)
    metas = store.metas("", list(range(16)), 0, 4)
    store.enqueue(metas[:2], [payload(0), payload(1)])
    assert store.to_spill(metas[2:]) == []
    assert store.counters.skipped_blocks == 2


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot mount a small file system here: {err}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, capture_output=True)


def test_a_full_disk_stops_spilling_and_fails_nothing(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", "64k") as root:
        disk = DiskTier(root, "model-a", "layout-1", 16 * 1024, 1000)
        store = store_of(disk)
        tokens = list(range(4 * 10))
        metas = store.metas("", tokens, 0, 10)
        store.enqueue(metas, [bytes([i]) * (16 * 1024) for i in range(10)])
        store.flush()
        stored, _ = store.take_reports()
        assert 0 < len(stored) < 10  # some fit, then the disk was full
        assert disk.write_failures >= 1 and disk.full_until > 0
        assert not [p for p in os.listdir(root) if p.endswith(".tmp")]
        # What was written reads back; what was not is simply not there.
        got = store.load(metas)
        assert len(got) == len(stored) and got[0] == bytes([0]) * (16 * 1024)
        store.close()


def test_a_host_tier_serves_first_and_reports_its_own_medium(tmp_path: Path) -> None:
    disk = make(tmp_path)
    store = store_of(disk, HostTier(capacity_blocks=2))
    metas = spill(store, list(range(16)))  # 4 blocks: the host keeps 2 + its margin
    stored, _ = store.take_reports()
    assert sorted(md for _, md in stored) == ["disk"] * 4 + ["host"] * 4
    disk.delete([metas[0].key])  # gone from disk: still served from host memory
    assert store.load(metas[:1]) == [payload(0)]
    store.evict([(metas[0].key, "host")])  # the service dropped it from the host tier
    assert store.load(metas[:1]) == []
    assert store.take_reports()[1] == [(metas[0].key, "host"), (metas[0].key, "disk")]


def test_a_host_tier_alone_needs_no_disk() -> None:
    fmt = BlockFormat("model-a", "layout-1", PAYLOAD)
    store = TierStore(BS, fmt, host=HostTier(capacity_blocks=100))
    assert store.start() == [] and store.load_worth(1e-9)  # memory: loading always pays
    metas = store.metas("", list(range(8)), 0, 2)
    store.enqueue(metas, [payload(0), payload(1)])
    assert store.load(metas) == [payload(0), payload(1)]
    assert [md for _, md in store.manifest()] == ["host", "host"]


def test_the_host_tier_keeps_a_payload_only_when_it_is_a_buffer_of_its_own() -> None:
    """A view into a larger array (the pool's gathered copy on a CPU) is copied, so holding
    one block does not keep the whole array alive; bytes and a buffer of its own (the pool's
    per-block copies on a GPU) are kept as they are, with no second copy on the model thread."""
    import numpy as np

    from worker.tier.store import own

    raw = bytes(range(8))
    assert own(raw) is raw
    whole = memoryview(raw)
    assert own(whole) is whole
    assert own(whole[2:6]) == raw[2:6] and isinstance(own(whole[2:6]), bytes)
    gathered = np.arange(16, dtype=np.uint8).reshape(2, 8)
    row = memoryview(gathered[1])
    kept = own(row)
    assert isinstance(kept, bytes) and kept == gathered[1].tobytes()
    own_buffer = np.arange(8, dtype=np.uint8).data
    assert own(own_buffer) is own_buffer


def test_a_load_into_an_arena_reads_the_same_blocks_into_reused_memory(tmp_path: Path) -> None:
    store = store_of(make(tmp_path))
    metas = spill(store, list(range(16)))
    arena = store.take_arena()
    assert arena.blocks == store.load_chunk and arena.slot > PAYLOAD
    got = store.load(metas, arena)
    assert got == [payload(i) for i in range(4)]
    assert all(isinstance(p, memoryview) and p.obj is arena[0].obj for p in got)
    store.give_arena(arena)
    assert store.take_arena() is arena  # kept for the next load
    # A corrupt file read into the arena fails as one read into fresh memory does.
    corrupt(store.disk.path(metas[2].key))
    assert store.load(metas, arena) == [payload(0), payload(1)]
    assert store.counters.load_failures == 2
    # Slots too small for a file (header and payload): read as they were before, whole.
    small = LoadArena(4, PAYLOAD)
    assert store.load(metas[:2], small) == [payload(0), payload(1)]
    store.close()
