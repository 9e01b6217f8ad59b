"""Scoring benchmark: what a prompt's logprobs cost (``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``), against prefilling the same prompt, in one run.

The whole system on the default model (``kvserve_launch``, one worker). For each of
``--prompts`` distinct prompts (the README's text, about 1,250 tokens, each with its own first
word so none shares a cached prefix with the others), four /v1/completions requests in turn,
``max_tokens`` 1, greedy:

- **cold**: the prompt, nothing cached;
- **cached**: the same prompt again (its prefix is reused);
- **echo + logprobs 1**: the prompt scored, as lm-evaluation-harness asks (no cached prefix is
  reused: every position's logits are needed);
- **prompt_logprobs 5**: vLLM's field, 5 alternatives per token.

Reported: seconds per request (median over the prompts) and the ratio to **cold**.

    python bench/bench_scoring.py                # 3 prompts, about a minute on 2 CPU cores
    python bench/bench_scoring.py --prompts 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve_launch.config import LaunchConfig  # noqa: E402
from kvserve_launch.process import KeptLines  # noqa: E402
from kvserve_launch.system import launch  # noqa: E402

KINDS = {
    "cold": {},
    "cached": {},
    "echo + logprobs 1": {"echo": True, "logprobs": 1},
    "prompt_logprobs 5": {"prompt_logprobs": 5},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--chars", type=int, default=4000, help="of the README per prompt")
    a = parser.parse_args()
    text = (ROOT / "README.md").read_text()[: a.chars]
    logs = KeptLines()
    config = LaunchConfig(
        workers=1, host="127.0.0.1", http_port=0, grpc_port=0, cache_port=0,
        admin_token="bench", startup_timeout_s=240.0,
    )  # fmt: skip
    system = launch(config, sink=logs)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    tokens = 0
    try:
        with httpx.Client(base_url=f"http://{system.http_address}/v1", timeout=600) as http:
            for i in range(a.prompts):
                body = {"prompt": f"{i} {text}", "max_tokens": 1, "temperature": 0}
                for kind, extra in KINDS.items():
                    start = time.perf_counter()
                    r = http.post("/completions", json={**body, **extra})
                    times[kind].append(time.perf_counter() - start)
                    r.raise_for_status()
                    tokens = r.json()["usage"]["prompt_tokens"]
    finally:
        system.stop(grace_s=10.0)
    cold = statistics.median(times["cold"])
    print(f"\n| {tokens}-token prompt, default model, {a.prompts} prompts | s (median) | / cold |")
    print("|---|---:|---:|")
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {kind} | {median:.2f} | {median / cold:.2f} |")


if __name__ == "__main__":
    main()
