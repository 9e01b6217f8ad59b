"""The early mask fill of a decode step that looks ahead (``worker.model.grammar``): the masks of
the state after each row's token, at batch 32.

A lookahead step knows its tokens before the engine appends them, and starts the next step's
masks then (``MaskPrefetch.start_after``). Four ways to get the same 32 masks, on each step of
32 matchers walking the examples of ``bench/structured_schemas.py`` (schema ``i % 20``,
compiled with the default model's tokenizer; a matcher that finished its example starts it
again):

- **now**: the loop's fill of the state after it consumed the tokens (``fill_masks``; the
  consumes not timed): the reference;
- **draft**: llguidance's draft-token fill (``fill_next_token_bitmask_par_with_draft_tokens``),
  which fills each state before and after its token and rolls the token back (kvserve's first
  early fill);
- **roll back**: the tokens checked, consumed together, the states after them filled, the
  tokens rolled back, the matchers left as they were (kvserve's second; the engine then waited
  for it and consumed the tokens again);
- **consume**: ``consume_then_fill``, kvserve's now: the tokens consumed together and the states
  after them filled; the engine does not consume them again, nor wait for it.

The first two ways alternate in order; then **consume** runs (it advances the matchers), then
the reference. Prints the median and p90 of a step's fill in microseconds; each way's masks
are checked against the reference's.

    .venv/bin/python bench/bench_mask_fill.py [--steps 200] [--model default]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import model_path  # type: ignore[import-not-found]
from structured_schemas import SCHEMAS  # type: ignore[import-not-found]

BATCH = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="default", help="default, tiny, or a model directory")
    args = ap.parse_args()

    from llguidance.numpy import (
        allocate_token_bitmask,
        fill_next_token_bitmask_par_with_draft_tokens,
    )

    from kvserve_model.structured_output import StructuredOutput
    from kvserve_model.tokenizer import load_tokenizer
    from worker.model import grammar
    from worker.model.grammar import Grammars, consume_then_fill, fill_masks

    path = Path(model_path(args.model))
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    tok = load_tokenizer(path)
    grammars = Grammars(tok.hf, vocab, [tok.hf.eos_token_id])
    matchers, walks = [], []
    for i in range(BATCH):
        s = SCHEMAS[i % len(SCHEMAS)]
        matchers.append(grammars.matcher(StructuredOutput.json_schema(s.schema)))
        text = json.dumps(s.example, separators=(", ", ": "))
        walks.append(tok.encode(text, add_special_tokens=False))
    at = [0] * BATCH
    executor = grammar._llg_executor()

    def draft(pairs: list[tuple[object, int]]) -> np.ndarray:
        both = allocate_token_bitmask(2 * len(pairs), vocab)
        fill_next_token_bitmask_par_with_draft_tokens(
            executor, [(m, 2 * i, [t]) for i, (m, t) in enumerate(pairs)], both
        )
        return both[1::2]

    def roll_back(pairs: list[tuple[object, int]]) -> np.ndarray:
        assert all(m.validate_tokens([t]) == 1 for m, t in pairs)  # type: ignore[attr-defined]
        consumed = executor.consume_token_par(pairs)
        masks = fill_masks([m for m, _ in pairs], vocab)
        for (m, _), ok in zip(pairs, consumed, strict=True):
            assert ok and m.rollback(1)  # type: ignore[attr-defined]
        return masks

    ways = {"draft": draft, "roll back": roll_back}
    times: dict[str, list[float]] = {"now": [], **{w: [] for w in ways}, "consume": []}
    for step in range(args.steps):
        tokens = []
        for i, m in enumerate(matchers):
            if at[i] == len(walks[i]):  # its example done: again from the start
                m.reset()
                at[i] = 0
            tokens.append(walks[i][at[i]])
            at[i] += 1
        pairs = list(zip(matchers, tokens, strict=True))
        order = list(ways) if step % 2 else list(reversed(ways))
        got = {}
        for w in order:
            t0 = time.perf_counter()
            got[w] = ways[w](pairs)
            times[w].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got["consume"] = consume_then_fill(pairs, vocab)  # the matchers advance
        times["consume"].append(time.perf_counter() - t0)
        assert not any(m.is_error() for m in matchers)
        t0 = time.perf_counter()
        want = fill_masks(matchers, vocab)
        times["now"].append(time.perf_counter() - t0)
        for w, masks in got.items():
            assert np.array_equal(masks, want), f"{w}: masks differ at step {step}"
    print(f"| fill of {BATCH} masks ({path.name}, {args.steps} steps) | median us | p90 us |")
    print("|---|---:|---:|")
    for w, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        print(f"| {w} | {statistics.median(ts) * 1e6:,.0f} | {q[-1] * 1e6:,.0f} |")


if __name__ == "__main__":
    main()
