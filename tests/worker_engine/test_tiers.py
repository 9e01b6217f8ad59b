"""The disk tier through the real engine and a real cache service: blocks the pool dropped,
and a whole system's restart, load back; output stays exactly the dense path's; a file that
is corrupt, truncated or another model's is recomputed, never served; a full disk fails
nothing. Workers run with --tier-load always: whether loading beats computing is measured
(a timing), and these tests are not about that."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import AUTH, BS, System, generate, request, started_system
from tests.worker_tier.test_disk_tier import small_filesystem
from worker.model.loader import LoadedModel
from worker.tier.block_file import decode_header

VOCAB = 256  # the tiny model's


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


async def disk_blocks(system: System, pool: str = "w0") -> int:
    stats = await system.stats(pool)
    return sum(t.blocks for t in stats.tiers if t.medium == kpb.MEDIUM_DISK)


async def wait_for_disk_blocks(system: System, n: int, pool: str = "w0") -> None:
    """Until the service has heard of ``n`` blocks in the pool's disk tier (written, then
    reported a quarter of a second later)."""
    for _ in range(200):
        if await disk_blocks(system, pool) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the disk tier never reported {n} blocks: {await disk_blocks(system)}")


async def flush_pool(system: System) -> None:
    await system.admin.Flush(kpb.FlushRequest(pool_id="w0"), metadata=AUTH)
    assert (await system.stats()).indexed_blocks == 0


async def info(stub) -> pb.WorkerInfo:
    return await stub.GetInfo(pb.GetInfoRequest())


@pytest.mark.parametrize("chunk", [64, 2])
async def test_blocks_the_pool_dropped_load_back_from_disk(
    system: System, reference, tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chunk``: blocks a load reads at a time (2: three chunks, the next read while one is
    written)."""
    monkeypatch.setattr("worker.tier.store.LOAD_CHUNK_BLOCKS", chunk)
    stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="always")
    p = prompt(1, 100)  # 6 full blocks of 16 before the last prompt token
    first = await generate(stub, request(p, max_tokens=24, logprobs=1))
    await system.wait_idle()
    await wait_for_disk_blocks(system, 6)
    await flush_pool(system)
    before = (await info(stub)).prefilled_tokens

    again = await generate(stub, request(p, max_tokens=24, logprobs=1))
    want_tokens, want_logprobs = reference(p, 24)
    assert first["tokens"] == again["tokens"] == want_tokens
    assert again["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
    assert again["last"].usage.cached_tokens == 6 * BS  # loaded, reported as cached
    got = await info(stub)
    assert got.prefilled_tokens - before == 100 - 6 * BS
    assert got.tier.loaded_tokens == 6 * BS and got.tier.load_failures == 0
    assert (await system.stats()).tier_hit_tokens == 6 * BS
    await system.wait_idle()


async def test_a_restarted_system_serves_its_prefixes_from_the_disk_tier(
    model: LoadedModel, reference, tmp_path: Path
) -> None:
    p = prompt(2, 150)  # 9 full blocks before the last prompt token
    async with started_system(model) as system:
        stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="always")
        await generate(stub, request(p, max_tokens=8))
        await system.wait_idle()
        await wait_for_disk_blocks(system, 9)
    # Everything stopped: the cache service, the worker. A new system on the same directory.
    async with started_system(model) as system:
        stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="always")
        await wait_for_disk_blocks(system, 9)  # the manifest
        got = await generate(stub, request(p, max_tokens=16))
        assert got["tokens"] == reference(p, 16)[0]
        assert got["last"].usage.cached_tokens == 9 * BS
        assert (await info(stub)).prefilled_tokens == 150 - 9 * BS
        await system.wait_idle()


def block_files(root: Path) -> dict[int, Path]:
    """The tier's files by block position (one sequence in the directory)."""
    out = {}
    for path in root.rglob("*.kvb"):
        meta, _ = decode_header(path.read_bytes())
        out[meta.position] = path
    return out


@pytest.mark.parametrize("chunk", [64, 2])
async def test_corrupt_truncated_and_foreign_files_are_recomputed(
    model: LoadedModel, reference, tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chunk`` 2: block 5 fails in the third chunk of a load, after two were written."""
    monkeypatch.setattr("worker.tier.store.LOAD_CHUNK_BLOCKS", chunk)
    p = prompt(3, 150)
    async with started_system(model) as system:
        stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="always")
        await generate(stub, request(p, max_tokens=8))
        await system.wait_idle()
        await wait_for_disk_blocks(system, 9)
    files = block_files(tmp_path)
    assert sorted(files)[:9] == list(range(9))
    # Block 5: a flipped payload byte. Block 7: truncated. Block 3: another model's file
    # (its header names another fingerprint) under this block's name.
    data = bytearray(files[5].read_bytes())
    data[-100] ^= 0x5A
    files[5].write_bytes(bytes(data))
    files[7].write_bytes(files[7].read_bytes()[:-1])
    foreign = files[3].read_bytes().replace(b'"fingerprint":"', b'"fingerprint":"x', 1)
    files[3].write_bytes(foreign)
    async with started_system(model) as system:
        stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="always")
        await asyncio.sleep(0.3)
        got = await generate(stub, request(p, max_tokens=16))
        assert got["tokens"] == reference(p, 16)[0]  # nothing wrong served
        # Blocks 0-2 load; 3 was dropped at the scan (foreign), so the run ends there. Blocks
        # 4-8 were of no use without it: the service refused them and the worker deleted
        # them (block 5's corrupt file too), then wrote 3-8 again from this request.
        assert got["last"].usage.cached_tokens == 3 * BS
        await system.wait_idle()
        await wait_for_disk_blocks(system, 9)
        # Block 5's corruption is found when it is read: corrupt the file written just now,
        # drop the pool's copies and ask again.
        again = block_files(tmp_path)
        data = bytearray(again[5].read_bytes())
        data[-100] ^= 0x5A
        again[5].write_bytes(bytes(data))
        await flush_pool(system)
        got = await generate(stub, request(p, max_tokens=16))
        assert got["tokens"] == reference(p, 16)[0]
        # Blocks 0-4 load; 5 fails its checksum: dropped, reported, computed again.
        assert got["last"].usage.cached_tokens == 5 * BS
        assert (await info(stub)).tier.load_failures >= 1
        await system.wait_idle()


async def test_a_full_disk_fails_no_request(system: System, reference, tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", "128k") as root:
        stub = await system.add_worker(offload_dir=str(root), offload_gb=0.001, tier_load="always")
        for seed in range(4):
            p = prompt(10 + seed, 120)
            got = await generate(stub, request(p, max_tokens=8))
            assert got["tokens"] == reference(p, 8)[0]
        await system.wait_idle()
        got = await info(stub)
        assert got.tier.write_failures >= 1  # the disk filled up; every request went on


async def test_tier_load_never_keeps_the_tier_and_computes(
    system: System, reference, tmp_path: Path
) -> None:
    stub = await system.add_worker(offload_dir=str(tmp_path), tier_load="never")
    p = prompt(4, 100)
    await generate(stub, request(p, max_tokens=8))
    await system.wait_idle()
    await wait_for_disk_blocks(system, 6)  # spilled all the same
    await flush_pool(system)
    again = await generate(stub, request(p, max_tokens=8))
    assert again["tokens"] == reference(p, 8)[0]
    assert again["last"].usage.cached_tokens == 0
    assert (await info(stub)).tier.loaded_tokens == 0
    await system.wait_idle()
