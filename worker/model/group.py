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
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.errors import BatchError, UnsupportedModelError

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
        return pickle.loads(self._exchange(0, None).tobytes())

    def _exchange(self, length: int, data: np.ndarray | None) -> np.ndarray:
        size = mx.distributed.all_sum(mx.array([length], dtype=mx.int64), group=self.group)
        n = int(np.array(size)[0])
        payload = mx.array(data) if data is not None else mx.zeros((n,), dtype=mx.uint8)
        out = mx.distributed.all_sum(payload, group=self.group)
        mx.eval(out)
        return np.array(out)


class GroupRunner:
    """Rank 0's runner in a group: every call in :data:`MIRRORED` is sent to the other ranks
    before it runs here, so they run the same forwards; everything else is the runner's.
    ``forward_async`` takes no lazy tokens (the decode lookahead is off in a group: its tokens
    would have to reach the other ranks before they exist)."""

    def __init__(self, runner: Any, channel: Channel) -> None:
        self._runner = runner
        self._channel = channel
        self.group_size = channel.group.size()

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


def follow(runner: Any, channel: Channel) -> int:
    """On ranks other than 0: make each call rank 0 sends on ``runner``, until it says stop.
    Returns the calls made."""
    calls = 0
    while True:
        name, args, kwargs = channel.receive()
        if name == STOP:
            return calls
        if name == SELF_CHECK:
            from worker.model.self_check import check_paged_parity

            check_paged_parity(runner.model, runner=runner)
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


def serve_follower(channel: Channel, build: Callable[[dict[str, Any]], Any] | None = None) -> int:
    """A follower's whole life: the first message says what to load and build
    (:func:`build_message`), then :func:`follow`. ``build`` makes the runner from it (default:
    :func:`build_runner`). Returns the calls made."""
    first = channel.receive()
    runner = (build or build_runner)(first)
    return follow(runner, channel)


def build_runner(message: dict[str, Any]) -> Any:
    """The model of ``message`` loaded, sharded over this process's group, and its runner built
    as rank 0 built its own (block size, block count, attention)."""
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner

    loaded = load_model(
        message["model"], dequantize=message.get("dequantize", "auto"), shard=sharding()
    )
    return ModelRunner.create(loaded.model, **message["runner"])
