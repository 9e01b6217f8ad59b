"""One rank of a 2-rank worker group over MLX's ring backend, for tests/worker/test_group.py:
run as ``python -m tests.worker.group_rank`` with ``MLX_RANK`` and ``MLX_HOSTFILE`` set. Rank 0
loads and shards the tiny model, builds its runner, tells the follower to build the same, drives
:func:`scenario` through a ``GroupRunner`` and prints the result as JSON; rank 1 serves."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

from kvserve_model.tiny_model import TINY_MODEL_NAME
from worker.errors import BatchError
from worker.model.forward_batch import SeqInput
from worker.model.group import (
    Channel,
    GroupRunner,
    build_message,
    init_group,
    serve_follower,
    shard_model,
)

BLOCK_SIZE = 8
NUM_BLOCKS = 48


def scenario(runner) -> dict:
    """Three prompts prefilled together, a copy-on-write copy of one's partial tail into a
    fourth sequence that continues it, then 12 greedy decode steps of all four, and one
    forward of several tokens a sequence (a verify forward): greedy tokens and the last
    logits. Then a tier's round trip: two blocks read out, written into other blocks, and a
    forward on them."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, n).tolist() for n in (19, 30, 7)]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    logits = runner.forward([SeqInput(p, t, 0) for p, t in zip(prompts, tables, strict=True)])
    prefill = np.array(logits).tolist()
    tokens = [[int(x)] for x in mx.argmax(logits, axis=-1).tolist()]
    pos = [len(p) for p in prompts]
    # A fourth sequence shares the first's 16-token prefix (2 full blocks) and its partial
    # third block by copy on write, then goes its own way.
    runner.copy_blocks([(tables[0][2], 24)])
    tables.append([tables[0][0], tables[0][1], 24, 25, 26, 27, 28, 29])
    tokens.append([7])
    pos.append(19)
    for _ in range(12):
        step = [SeqInput([t[-1]], tb, p) for t, tb, p in zip(tokens, tables, pos, strict=True)]
        logits = runner.forward(step)
        for i, x in enumerate(mx.argmax(logits, axis=-1).tolist()):
            tokens[i].append(int(x))
            pos[i] += 1
    try:  # a bad batch is refused on every rank before any collective; the group goes on
        runner.forward([SeqInput([1], [NUM_BLOCKS + 5], 0)])
        refused = False
    except BatchError:
        refused = True
    verify = runner.forward_all(
        [SeqInput(t[-3:], tb, p - 2) for t, tb, p in zip(tokens, tables, pos, strict=True)]
    )
    # The tiers' copies (a group's pool gathers and scatters every rank's slice): the first
    # prompt's two full blocks out, into blocks 40 and 41, and its last three tokens computed
    # on them, as a sequence that loaded its prefix from a tier would.
    pool = runner.pool
    payloads = [bytes(p) for p in pool.read_blocks([tables[0][0], tables[0][1]])]
    pool.write_blocks([40, 41], payloads)
    reread = [bytes(p) for p in pool.read_blocks([40, 41])]
    reloaded = runner.forward([SeqInput(prompts[0][16:], [40, 41, 42], 16)])
    try:  # a payload of the wrong size is refused before any rank writes
        pool.write_blocks([43], [payloads[0][:-4]])
        bad_payload = False
    except BatchError:
        bad_payload = True
    return {
        "tokens": tokens,
        "logits": np.array(logits).tolist(),
        "logits_prefill": prefill,
        "verify": [np.array(v).tolist() for v in verify],
        "refused": refused,
        "payload": np.frombuffer(payloads[0], np.float32).tolist(),
        "payload_bytes": pool.bytes_per_block,
        "layout": pool.describe_layout(),
        "reread_same": reread == payloads,
        "reloaded": np.array(reloaded).tolist(),
        "bad_payload_refused": bad_payload,
    }


def main() -> None:
    group = init_group("ring")
    channel = Channel(group)
    if group.rank() != 0:
        calls = serve_follower(channel)
        print(json.dumps({"rank": group.rank(), "calls": calls}))
        return
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner

    model = load_model(TINY_MODEL_NAME).model
    shard_model(model, group)
    runner = ModelRunner.create(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    channel.send(build_message(TINY_MODEL_NAME, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    lead = GroupRunner(runner, channel)
    out = scenario(lead)
    lead.ping()  # a sign of life: the follower takes it and counts no call
    lead.stop()
    kv = runner.pool.layer_arrays(0)[0].shape[0]
    print(json.dumps({"rank": 0, "size": group.size(), "kv_heads": kv, **out}))


if __name__ == "__main__":
    sys.exit(main())
