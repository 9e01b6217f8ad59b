"""bench/bench_gateway_overhead.py's arithmetic, on made-up bursts (no processes, no timing):
the rotated mode order, the per-mode figures, the paired ratios and the table's verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_gateway_overhead.py"
_spec = importlib.util.spec_from_file_location("bench_gateway_overhead", PATH)
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)
Result = bench.Result


def result(tokens: int, ttft: float, itl: list[float], ok: bool = True) -> Result:
    return Result(ok=ok, ttft=ttft, itl=itl, output_tokens=tokens, tokens_from_usage=True)


def burst(mode: str, repeat: int, wall: float, results: list[Result], gw_cpu: float = 0.0):
    return bench.Burst(mode, repeat, wall, results, {"gateway": gw_cpu, "worker": 1.0})


def test_order_rotates_every_mode_through_every_position() -> None:
    orders = [bench.order(r) for r in range(3)]
    assert orders[0] == list(bench.MODES)
    assert orders[1] == [*bench.MODES[1:], bench.MODES[0]]
    for position in range(3):
        assert {o[position] for o in orders} == set(bench.MODES)


def test_figures_median_rate_and_latency_over_all_requests() -> None:
    bursts = [
        burst("direct", 0, 1.0, [result(100, 0.1, [0.01] * 3), result(100, 0.3, [0.03])], 0.0),
        burst("direct", 1, 2.0, [result(100, 0.2, [0.02])]),
        burst("direct", 2, 4.0, [result(100, 0.2, [0.02]), result(7, 0.9, [], ok=False)]),
        burst("gateway gRPC", 0, 1.0, [result(50, 0.5, [0.05])], 0.4),
    ]
    rows = bench.figures(bursts)
    assert [r.mode for r in rows] == ["direct", "gateway gRPC"]  # no HTTP burst: no row
    direct, grpc_ = rows
    assert direct.bursts == 3 and direct.failed == 1
    assert direct.tok_s == 50.0  # rates 200, 50, 25: the median
    assert (direct.tok_s_min, direct.tok_s_max) == (25.0, 200.0)
    assert direct.ttft_p50 == 0.2  # 0.1, 0.3, 0.2, 0.2 (the failed request left out)
    assert direct.itl_p50 == pytest.approx(0.015)  # gaps 0.01 x3, 0.02 x2, 0.03
    # 4 ok requests: 4 + 2 + 2 + 2 messages with tokens (a gap each, plus the first), 400
    # tokens (the failed request's not counted)
    assert direct.events_per_token == pytest.approx(10 / 400)
    assert grpc_.cpu_per_ktok["gateway"] == pytest.approx(1000 * 0.4 / 50)
    assert direct.cpu_per_ktok["worker"] == pytest.approx(1000 * 3.0 / 400)


def test_pair_ratios_compare_within_a_repeat() -> None:
    bursts = [
        burst("direct", 0, 1.0, [result(100, 0.1, [])]),
        burst("gateway HTTP", 0, 2.0, [result(100, 0.1, [])]),
        burst("direct", 1, 1.0, [result(200, 0.1, [])]),
        burst("gateway HTTP", 1, 1.0, [result(190, 0.1, [])]),
        burst("gateway HTTP", 2, 1.0, [result(190, 0.1, [])]),  # no direct burst in repeat 2
    ]
    assert bench.pair_ratios(bursts, "gateway HTTP") == [0.5, 0.95]


def test_markdown_ratios_and_verdicts() -> None:
    bursts = [
        burst("direct", 0, 1.0, [result(1000, 0.10, [0.010])]),
        burst("gateway gRPC", 0, 1.0, [result(960, 0.12, [0.011])], 0.2),
        burst("gateway HTTP", 0, 1.0, [result(900, 0.15, [0.012])], 0.2),
    ]
    text = bench.markdown(bench.figures(bursts), bursts)
    lines = text.splitlines()
    assert lines[0].startswith("| mode | bursts | failed | out tok/s (median) |")
    assert "gateway CPU s / 1k tok" in lines[0] and "worker CPU s / 1k tok" in lines[0]
    assert "| gateway gRPC | 0.96 | 0.96 | 0.960 | 1.20 | 1.10 | met |" in lines
    assert "| gateway HTTP | 0.90 | 0.90 | 0.900 | 1.50 | 1.20 | missed |" in lines
    # Every table row has as many cells as its header.
    for table in text.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1


def test_the_verdict_is_the_median_of_paired_ratios() -> None:
    """Noise that slows one repeat's every mode moves the medians apart, not the pairs."""
    rates = {0: (1000, 960), 1: (400, 392), 2: (1000, 970)}  # repeat: (direct, gRPC) tokens
    bursts = [
        burst(mode, repeat, 1.0, [result(tokens, 0.1, [])])
        for repeat, pair in rates.items()
        for mode, tokens in zip(("direct", "gateway gRPC"), pair, strict=True)
    ]
    rows = bench.figures(bursts)
    assert rows[1].tok_s / rows[0].tok_s == 0.96
    pairs = bench.pair_ratios(bursts, "gateway gRPC")
    assert pairs == pytest.approx([0.96, 0.98, 0.97])
    line = bench.markdown(rows, bursts).splitlines()[-1]  # the ratio table's only row
    assert line.startswith("| gateway gRPC | 0.96 | 0.96, 0.98, 0.97 | 0.970 |")
    assert line.endswith("| met |")


def test_markdown_without_the_direct_mode_has_no_ratios() -> None:
    bursts = [burst("gateway gRPC", 0, 1.0, [result(10, 0.1, [])])]
    text = bench.markdown(bench.figures(bursts), bursts)
    assert "Gateway / direct" not in text


def test_settings_show_what_the_processes_read_and_no_token() -> None:
    env = {
        "KVSERVE_BLAS_THREADS": "1",
        "KVWORKER_MAX_BATCH_SIZE": "64",
        "BLIS_NUM_THREADS": "2",
        "KVSERVE_ADMIN_TOKEN": "secret",
        "HOME": "/root",
    }
    assert bench.settings(env) == [
        "BLIS_NUM_THREADS=2",
        "KVSERVE_BLAS_THREADS=1",
        "KVWORKER_MAX_BATCH_SIZE=64",
    ]
