"""bench/serving/run.py without servers: the GPU suite's workload table, the first-request
TTFT against the deferred ones, and the report's GPU tables from made-up figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run() -> Any:
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "bench_serving_run", ROOT / "bench/serving/run.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved  # run.py puts bench/ and bench/serving/ first
        sys.modules.pop(spec.name, None)


def test_gpu_suite_has_issue_14_shapes(run: Any) -> None:
    ws = {w.name: w for w in run.gpu_workloads()}
    assert list(ws) == [g.name for g in run.GPU_WORKLOADS]
    shared = ws["shared-prefix 8k x64"]
    assert len(shared.requests) == 64
    systems = {r.messages[0]["content"] for r in shared.requests}
    assert len(systems) == 1 and len(systems.pop()) == 8000
    assert {len(r.messages[1]["content"]) for r in shared.requests} == {32}
    assert len({r.messages[1]["content"] for r in shared.requests}) == 64
    assert {r.max_tokens for r in shared.requests} == {64}
    long = ws["shared-prefix 32k x8"]
    assert len(long.requests) == 8 and len(long.requests[0].messages[0]["content"]) == 32000
    chats = ws["multi-turn 4k"].chats
    assert len(chats) == 8 and all(len(c.user_turns) == 4 for c in chats)
    assert {len(c.system) for c in chats} == {4000} and len({c.system for c in chats}) == 1
    unique = ws["unique prompts 2k"].clients
    prompts = [r.prompt for c in unique for r in c]
    assert len(unique) == 32 and len(set(prompts)) == 64 and {len(p) for p in prompts} == {2000}
    decode = ws["decode-heavy"].requests
    assert len(decode) == 32 and {r.max_tokens for r in decode} == {256}
    # a 32k prompt, the chat template and the output fit the context the suite declares
    assert run.GPU_CONTEXT > 32000 + 32 + 64 + 100


def test_gpu_scale_shrinks_prompts_and_clients(run: Any) -> None:
    ws = {w.name: w for w in run.gpu_workloads(0.05)}
    shared = ws["shared-prefix 8k x64"]
    assert len(shared.requests) == 3 and len(shared.requests[0].messages[0]["content"]) == 400
    assert shared.requests[0].max_tokens == 64
    assert len(ws["decode-heavy"].requests) == 2
    assert len(ws["decode-heavy"].requests[0].prompt) == 96


def test_first_vs_rest(run: Any) -> None:
    ttfts = [5.0, 0.5, 1.0, 2.0, None]
    results = [run.Result(ok=t is not None, ttft=t) for t in ttfts]
    f = run.first_vs_rest(results, batch=3)
    assert f["first"] == 0.5
    assert f["rest"]["n"] == 3 and f["rest"]["p50"] == 2.0 and f["rest"]["max"] == 5.0
    assert f["batch_rest"] == {"p50": 1.5, "max": 2.0, "n": 2}
    assert run.first_vs_rest([run.Result(ok=False)]) == {}


def summary(tok_s: float, ttft: float, tpot: float, requests: int = 32) -> dict[str, Any]:
    spread = {"p50": ttft, "p95": ttft, "p99": ttft}
    return {
        "requests": requests,
        "failed": 0,
        "retries": 0,
        "output_tok_s": tok_s,
        "requests_s": 1.0,
        "ttft": spread,
        "itl": spread,
        "tpot": {"p50": tpot, "p95": tpot, "p99": tpot},
        "e2e": spread,
        "cached_fraction": None,
        "server_peak_rss_mb": 100.0,
        "server_cpu_s": 1.0,
        "output_tokens": 10,
        "content_events": 10,
        "errors": [],
        "ttft_p50_by_tag": {},
        "rate": None,
        "first_vs_rest": {
            "first": 0.5,
            "rest": {"p50": 1.0, "p95": 2.0, "p99": 2.0, "max": 3.0, "n": 63},
            "batch_rest": {"p50": 0.9, "max": 1.0, "n": 31},
            "batch": 32,
        },
    }


def gpu_report(names: list[str], servers: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """A GPU suite run's JSON, as ``run.markdown`` reads it: ``names`` the workloads (bursts),
    ``servers`` each server's figures, ``dense`` the ``batch_generate`` reference."""
    return {
        "date": "2026-11-26",
        "command": "python3 bench/serving/run.py --gpu",
        "suite": "gpu",
        "machine": {
            "gpu": "NVIDIA H100",
            "cores": 16,
            "cpu": "x",
            "memory_gib": 1,
            "device": "gpu",
            "mlx": "0",
            "mlx_lm": "0",
            "blas": "n/a (GPU)",
            "python": "3.12",
            "load_before": 0.0,
        },
        "model": "m",
        "wall_min": 1.0,
        "plot": "p.png",
        "workloads": [{"name": w, "shape": "s", "pattern": "burst"} for w in names],
        "rates": {},
        "derived_rates": [],
        "rate_server": "mlx_lm.server",
        "dense_decode": dense,
        "servers": servers,
    }


def test_gpu_report_marks_issue_14_targets(run: Any) -> None:
    names = ["shared-prefix 8k x64", "decode-heavy"]
    servers = {
        "mlx_lm.server": {
            "ready_s": 1.0,
            "workloads": {names[0]: summary(100, 10.0, 0.04), names[1]: summary(900, 1, 0.04)},
        },
        "kvserve": {
            "ready_s": 1.0,
            "workloads": {names[0]: summary(400, 0.5, 0.04), names[1]: summary(800, 1, 0.034)},
        },
    }
    dense = {"generation_tps": 1000.0, "runs": [{"generation_tps": 1000.0}]}
    data = gpu_report(names, servers, dense)
    text = run.markdown(data)
    m = "mlx_lm.server"
    assert (
        f"| shared-prefix 8k x64 | TTFT p50 at least 10x lower | {m} | 20.00x lower | met |" in text
    )
    assert f"| shared-prefix 8k x64 | output tok/s at least 3x | {m} | 4.00x | met |" in text
    assert (
        f"| decode-heavy | no workload below 1.0x (output tok/s) | {m} | 0.89x | missed |" in text
    )
    # 32 / 0.034 s = 941 tok/s against 1,000: within 10%
    assert "within 10% of dense mlx-lm | `batch_generate` | 0.94x | met |" in text
    assert "| shared-prefix 8k x64 | kvserve | 0.50 | 1.00 | 2.00 | 3.00 | 0.90 | 1.00 |" in text
    assert "Issue 13's targets" not in text


def test_every_baseline_variant_gets_its_target_rows(run: Any) -> None:
    """A variant of mlx_lm.server (fewer prompts or decodes at once) that ran the shared-prefix
    bursts is a baseline of its own in the targets and the ratio tables."""
    assert set(run.BASELINE_VARIANTS) <= set(run.SERVERS)
    name = "shared-prefix 8k x64"
    servers = {
        "mlx_lm.server-p1-d8": {"ready_s": 1.0, "workloads": {name: summary(150, 17.0, 0.1)}},
        "kvserve": {"ready_s": 1.0, "workloads": {name: summary(2100, 0.8, 0.011)}},
    }
    data = gpu_report([name], servers, {})
    text = run.markdown(data)
    base = "mlx_lm.server-p1-d8"
    assert f"kvserve / {base} (above 1 is better" in text
    assert f"| {name} | TTFT p50 at least 10x lower | {base} | 21.25x lower | met |" in text
    assert f"| {name} | output tok/s at least 3x | {base} | 14.00x | met |" in text
