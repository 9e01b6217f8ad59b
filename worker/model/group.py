"""A worker group: one model sharded over N ranks with ``mx.distributed``, one paged pool split
by KV heads, rank 0 driving the others (issue 36, tensor parallel; docs/tensor-parallel.md).

mlx-lm's own ``Model.shard(group)`` splits each layer's attention heads and MLP columns over the
ranks (llama, qwen2, qwen3, ... have it); after it a layer's cache sees ``n_kv_heads / N`` heads,
so a :class:`~worker.model.runner.ModelRunner` built on a rank's sharded model holds that rank's
slice of every block: the same block ids, the same tables, a fraction of the bytes. Nothing in
the paged path changes; the all-reduces are inside the sharded linear layers.

Every rank must run every forward, with the same inputs, in the same order (each all-reduce is
a collective). Rank 0 owns the engine: :class:`GroupRunner` stands in for its runner and, before
each call that touches the model or the pool, broadcasts the call (:class:`Channel`); the other
ranks run :func:`follow`, which makes the same call on their own runner and drops the result
(the logits are replicated: every rank's LM head sees the whole hidden state). A follower builds
its runner from the first message (:func:`serve_follower`), so the pool has the block count
rank 0 chose.

The channel is the group itself: a message is a length, then its pickled bytes, each an
``all_sum`` to which only rank 0 contributes (the followers add zeros), so no second transport
needs addresses or ports. Messages come only from rank 0 of the same group (trusted, as the
group's own collectives are).

The KV tiers stay rank 0's (:class:`GroupPool`): a block spilled is gathered from every rank's
slice into one payload of the whole block, in the layout a worker of one process writes, and a
block loaded is sent to every rank, which writes its own slice. So only rank 0 has tier files,
scans them and answers for them (no agreement between ranks on what each holds), and a file
serves a worker of any group size on the same model.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.errors import BatchError, UnsupportedModelError
from worker.model.kv_pool import check_payloads, describe_layout, write_rate
from worker.model.spec import LayerSpec

log = logging.getLogger(__name__)

# The runner calls a group mirrors on every rank: each runs the model or changes the pool.
MIRRORED = frozenset(
    {
        "forward",
        "forward_all",
        "copy_blocks",
        "choose_decode_attention",
        "prepare_compiled_decode",
        "prepare_compiled_decodes",
    }
)
STOP = "stop"
SELF_CHECK = "self_check"
# Rank 0's sign of life while it has nothing else to send (``worker.engine.stall_watch.pings``):
# a follower whose leader's machine vanished without closing its socket hears nothing more,
# and ends itself (``worker.group_launch.watch_messages``) so that the group can form again.
PING = "ping"
# The pool's block copies for the tiers (GroupPool): made on every rank, joined on rank 0.
POOL_READ = "pool.read_blocks"
POOL_WRITE = "pool.write_blocks"


def init_group(backend: str = "any") -> mx.distributed.Group:
    """This process's group (``MLX_RANK``, ``MLX_HOSTFILE`` and the backend's variables, as
    ``mlx.launch`` sets them); a group of one where none is configured."""
    return mx.distributed.init(strict=False, backend=backend)


def sharding(backend: str = "any") -> Callable[[nn.Module], None]:
    """For ``load_model(shard=...)``: joins this process's group and shards the model over it
    (before its weights are evaluated: a rank loads only its share)."""

    def shard(model: nn.Module) -> None:
        shard_model(model, init_group(backend))

    return shard


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Shard ``model`` over ``group`` with mlx-lm's own ``shard()``; a family without it, or
    whose heads do not divide by the group's size, is refused in one line. Lazy: the caller
    evaluates the parameters (each rank's share only)."""
    n = group.size()
    if n == 1:
        return
    kind = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(
            f"{kind}: mlx-lm has no shard() for this family, so it cannot run tensor parallel"
        )
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("KV heads", kv_heads)):
        if isinstance(count, int) and count % n:
            raise UnsupportedModelError(
                f"{kind}: {count} {what} do not divide over {n} ranks (each rank holds a share)"
            )
    model.shard(group)


class Channel:
    """Rank 0's messages to the other ranks of ``group``, over the group's own collectives."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.received_at = time.monotonic()  # when the last message arrived (followers)

    @property
    def leader(self) -> bool:
        return self.group.rank() == 0

    def send(self, message: object) -> None:
        """On rank 0: every other rank's next :meth:`receive` returns ``message``."""
        if not self.leader:
            raise RuntimeError("only rank 0 sends")
        data = np.frombuffer(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self._exchange(len(data), data)

    def receive(self) -> Any:
        """On the other ranks: rank 0's next message."""
        if self.leader:
            raise RuntimeError("rank 0 does not receive")
        message = pickle.loads(self._exchange(0, None).tobytes())
        self.received_at = time.monotonic()
        return message

    def _exchange(self, length: int, data: np.ndarray | None) -> np.ndarray:
        size = mx.distributed.all_sum(mx.array([length], dtype=mx.int64), group=self.group)
        n = int(np.array(size)[0])
        payload = mx.array(data) if data is not None else mx.zeros((n,), dtype=mx.uint8)
        out = mx.distributed.all_sum(payload, group=self.group)
        mx.eval(out)
        return np.array(out)


def slice_lengths(pool: Any) -> list[int]:
    """Bytes of a rank's payload segments, in payload order: per layer, K then V."""
    size, bs = pool.dtype.size, pool.block_size
    out = []
    for s in pool.layers:
        out += [s.n_kv_heads * bs * s.k_head_dim * size, s.n_kv_heads * bs * s.v_head_dim * size]
    return out


def gather_blocks(pool: Any, blocks: list[int], group: mx.distributed.Group) -> np.ndarray | None:
    """Every rank's slice of ``blocks`` (a collective: every rank calls it): on rank 0 the
    whole blocks, ``[n, ranks * slice bytes]`` in one process's payload layout; None on the
    others. Raises on rank 0 if any rank could not read its slice."""
    n, rank, size = len(blocks), group.rank(), group.size()
    slice_len = sum(slice_lengths(pool))
    rows = np.zeros((size, 1 + n * slice_len), np.uint8)
    try:
        payloads = pool.read_blocks(blocks)
        rows[rank, 1:] = np.concatenate([np.frombuffer(p, np.uint8) for p in payloads])
        rows[rank, 0] = 1
    except Exception:  # the collective goes on; rank 0 sees the flag
        log.exception("worker group: reading %d blocks on rank %d failed", n, rank)
    joined = mx.distributed.all_sum(mx.array(rows), group=group)
    mx.eval(joined)
    if rank != 0:
        return None
    every = np.array(joined)
    failed = [r for r in range(size) if every[r, 0] != 1]
    if failed:
        raise RuntimeError(f"ranks {failed} of the group could not read blocks {blocks[:8]}")
    slices = every[:, 1:].reshape(size, n, slice_len)
    parts, offset = [], 0
    for length in slice_lengths(pool):  # a segment of the whole block: rank 0's, rank 1's, ...
        part = slices[:, :, offset : offset + length]
        parts.append(part.transpose(1, 0, 2).reshape(n, size * length))
        offset += length
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def scatter_blocks(
    pool: Any, blocks: list[int], whole: np.ndarray, group: mx.distributed.Group
) -> None:
    """Writes this rank's slice of each whole block in ``whole`` ``[n, ranks * slice bytes]``
    into ``blocks`` (a collective: every rank calls it with the same arguments). Raises on
    rank 0 if any rank's write failed."""
    rank, size = group.rank(), group.size()
    failed = 1
    try:
        parts, offset = [], 0
        for length in slice_lengths(pool):
            start = offset * size + rank * length
            parts.append(whole[:, start : start + length])
            offset += length
        mine = np.ascontiguousarray(np.concatenate(parts, axis=1))
        pool.write_payloads(blocks, list(mine))
        failed = 0
    except Exception:
        log.exception("worker group: writing %d blocks on rank %d failed", len(blocks), rank)
    total = mx.distributed.all_sum(mx.array([failed], dtype=mx.int32), group=group)
    if int(np.array(total)[0]) and rank == 0:
        raise RuntimeError(f"a rank of the group could not write blocks {blocks[:8]}")


class GroupPool:
    """Rank 0's pool as the tiers see it in a group: whole blocks (every rank's KV heads), in
    the payload layout of a one-process worker (``KVPool.read_blocks``). Reading gathers each
    rank's slice; writing sends the whole blocks to every rank, which writes its own slice.
    On the model thread (the calls are collectives, ordered with the forwards). Everything
    else is rank 0's pool."""

    def __init__(self, pool: Any, channel: Channel) -> None:
        self._pool = pool
        self._channel = channel
        self.ranks = channel.group.size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    @property
    def bytes_per_block(self) -> int:
        return int(self._pool.bytes_per_block) * self.ranks

    def describe_layout(self) -> str:
        whole = [
            LayerSpec(s.n_kv_heads * self.ranks, s.k_head_dim, s.v_head_dim)
            for s in self._pool.layers
        ]
        return describe_layout(whole, self._pool.block_size, self._pool.dtype)

    def read_blocks(self, blocks: list[int]) -> list[memoryview]:
        if not blocks:
            return []
        self._pool.check_blocks(blocks)
        self._channel.send((POOL_READ, (list(blocks),), {}))
        whole = gather_blocks(self._pool, list(blocks), self._channel.group)
        assert whole is not None
        return [memoryview(row) for row in whole]

    def write_blocks(self, blocks: list[int], payloads: list[bytes | memoryview]) -> None:
        if not blocks:
            return
        self._pool.check_blocks(blocks)
        check_payloads(blocks, payloads, self.bytes_per_block)
        self._write(list(blocks), np.stack([np.frombuffer(p, np.uint8) for p in payloads]))

    def _write(self, blocks: list[int], whole: np.ndarray) -> None:
        self._channel.send((POOL_WRITE, (blocks, whole), {}))
        scatter_blocks(self._pool, blocks, whole, self._channel.group)

    def measure_write_rate(self, blocks: int = 32) -> float:
        """Bytes a second a load moves into the group's pool (the message to every rank and
        their writes), writing zeros into the trash block, as ``KVPool.measure_write_rate``."""
        whole = np.zeros((blocks, self.bytes_per_block), np.uint8)
        trash = [int(self._pool.trash_block)] * blocks
        return write_rate(lambda: self._write(trash, whole), blocks * self.bytes_per_block)


class GroupRunner:
    """Rank 0's runner in a group: every call in :data:`MIRRORED` is sent to the other ranks
    before it runs here, so they run the same forwards; everything else is the runner's.
    ``forward_async`` takes no lazy tokens (the decode lookahead is off in a group: its tokens
    would have to reach the other ranks before they exist)."""

    def __init__(self, runner: Any, channel: Channel) -> None:
        self._runner = runner
        self._channel = channel
        self.group_size = channel.group.size()
        inner = getattr(runner, "pool", None)
        self._pool = GroupPool(inner, channel) if inner is not None else None

    @property
    def pool(self) -> GroupPool | None:
        """The group's pool as the tiers see it (whole blocks); None for a runner without."""
        return self._pool

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._runner, name)
        if name not in MIRRORED or not callable(attr):
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            self._channel.send((name, args, kwargs))
            return attr(*args, **kwargs)

        return mirrored

    def forward_async(self, seqs: Any, tokens: mx.array | None = None) -> mx.array:
        if tokens is not None:
            raise ValueError("a worker group runs no forward on lazy tokens (no lookahead)")
        self._channel.send(("forward", (seqs,), {}))
        return self._runner.forward_async(seqs)

    def describe(self) -> str:
        return f"{self._runner.describe()}, tensor parallel over {self.group_size} ranks"

    def self_check(self) -> Any:
        """The start-up self-check (``worker.model.self_check``) on every rank at once: its
        dense mlx-lm forwards all-reduce too, so the other ranks run the same check."""
        from worker.model.self_check import check_paged_parity

        self._channel.send((SELF_CHECK, (), {}))
        return check_paged_parity(self._runner.model, runner=self._runner)

    def stop(self) -> None:
        """Ends the other ranks' :func:`follow` loops."""
        self._channel.send((STOP, (), {}))

    def ping(self) -> None:
        """Tells the other ranks rank 0 is alive (on the model thread, between jobs)."""
        self._channel.send((PING, (), {}))


def follow(runner: Any, channel: Channel) -> int:
    """On ranks other than 0: make each call rank 0 sends on ``runner``, until it says stop.
    Returns the calls made."""
    calls = 0
    while True:
        name, args, kwargs = channel.receive()
        if name == STOP:
            return calls
        if name == PING:
            continue
        if name == SELF_CHECK:
            from worker.model.self_check import check_paged_parity

            check_paged_parity(runner.model, runner=runner)
            calls += 1
            continue
        if name == POOL_READ:
            (blocks,) = args
            gather_blocks(runner.pool, blocks, channel.group)
            calls += 1
            continue
        if name == POOL_WRITE:
            blocks, whole = args
            scatter_blocks(runner.pool, blocks, whole, channel.group)
            calls += 1
            continue
        if name not in MIRRORED:
            raise RuntimeError(f"rank 0 sent a call a group does not mirror: {name}")
        try:
            out = getattr(runner, name)(*args, **kwargs)
            if isinstance(out, mx.array):
                mx.eval(out)
        except BatchError as e:
            # Refused before any collective, on rank 0 too (the same inputs, the same checks):
            # rank 0 fails that step and the group goes on.
            log.warning("worker group: a %s refused on this rank as on rank 0: %s", name, e)
        calls += 1


def build_message(model: str, dequantize: str = "auto", **runner: Any) -> dict[str, Any]:
    """What rank 0 sends first: the model to load (as ``load_model`` takes it) and how to
    build the runner (``ModelRunner.create``'s keywords)."""
    return {"model": model, "dequantize": dequantize, "runner": runner}


def serve_follower(
    channel: Channel,
    build: Callable[[dict[str, Any]], Any] | None = None,
    on_built: Callable[[], None] | None = None,
) -> int:
    """A follower's whole life: the first message says what to load and build
    (:func:`build_message`), then :func:`follow`. ``build`` makes the runner from it (default:
    :func:`build_runner`); ``on_built`` runs once it is built (before the first call). Returns
    the calls made."""
    first = channel.receive()
    runner = (build or build_runner)(first)
    if on_built is not None:
        on_built()
    return follow(runner, channel)


def build_runner(message: dict[str, Any]) -> Any:
    """The model of ``message`` loaded, sharded over this process's group, and its runner built
    as rank 0 built its own (block size, block count, attention)."""
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner

    loaded = load_model(
        message["model"],
        dequantize=message.get("dequantize", "auto"),
        shard=sharding(),
        tokenizer=False,
    )
    return ModelRunner.create(loaded.model, **message["runner"])
