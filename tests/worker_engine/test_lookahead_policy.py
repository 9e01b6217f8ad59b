"""The decode lookahead's policy (``worker.engine.lookahead.Policy``): on, off, or by the
measured steps (auto), against a naive model of what it should decide; and the executor
measuring real forwards for it."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import generate, request, started_system
from worker.engine.lookahead import Policy

MS = 1e-3


def test_on_and_off_are_fixed_and_measure_nothing() -> None:
    on, off = Policy("on"), Policy("off")
    for _ in range(200):
        assert on.wants() and not off.wants()
        on.measured(0.0, 0.0, 1.0, 1.0)  # a step all wait: auto would turn on
        off.measured(0.0, 0.0, 1.0, 1.0)
    assert not on.measuring and not off.measuring
    assert on.active and not off.active and on.switches == off.switches == 0


def test_auto_is_off_on_a_cpu_and_an_unknown_mode_is_refused() -> None:
    assert Policy.for_device("auto", gpu=False).mode == "off"
    assert Policy.for_device("auto", gpu=True).mode == "auto"
    assert Policy.for_device("on", gpu=False).mode == "on"
    with pytest.raises(ValueError, match="auto, on, off"):
        Policy("sometimes")


def test_auto_turns_on_where_the_device_outlasts_the_launches() -> None:
    """A long-context step (the device waited 2.9 ms past the launches of a 13.5 ms step, the
    loop idle 4 ms: saves min(2.9, 4 + 1.5) = 2.9 ms, 21%) turns it on after ``min_samples``;
    a short-context one (0.1 ms of 9 ms, 1.1%) never does."""
    long, short = Policy("auto"), Policy("auto")
    for _ in range(long.min_samples):
        assert not long.wants() and not short.wants()
        long.measured(4 * MS, 1.5 * MS, 2.9 * MS, 13.5 * MS)
        short.measured(4 * MS, 1.5 * MS, 0.1 * MS, 9 * MS)
    assert long.active and long.switches == 1
    assert not short.active and short.switches == 0
    assert long.saved_s == pytest.approx(2.9 * MS)


def test_the_saving_is_bounded_by_the_host_work_it_overlaps() -> None:
    """The device waiting 5 ms is worth only the 0.2 ms the loop and the build take (2% of
    the step): the next forward cannot launch before this one ends, so nothing else
    overlaps."""
    p = Policy("auto")
    for _ in range(p.min_samples):
        p.measured(0.1 * MS, 0.1 * MS, 5 * MS, 10 * MS)
    assert not p.active and p.saved_s == pytest.approx(0.2 * MS)


def test_while_on_it_probes_and_turns_off_when_the_saving_goes() -> None:
    """On, every ``probe_every``-th step does not look ahead (the next one measures its own
    forward); the contexts shrink, the probes measure no saving, and it turns off."""
    p = Policy("auto", probe_every=4, min_samples=2)
    for _ in range(2):
        p.measured(4 * MS, 1 * MS, 3 * MS, 12 * MS)
    assert p.active
    assert [p.wants() for _ in range(12)] == [True, True, True, False] * 3
    probes = 0
    while p.active:
        if not p.wants():  # a probe: the next step measures its own forward, saving nothing
            probes += 1
            p.measured(4 * MS, 1 * MS, 0.0, 8 * MS)
        assert probes < 20
    assert p.switches == 2 and probes > 1  # a moving average: not on one probe


def test_auto_follows_a_naive_model_of_the_rule() -> None:
    """Random measurements against a direct computation of the rule: moving averages of the
    saving and the period, on at ``on_share``, off under ``off_share``, never before
    ``min_samples``."""
    rng = random.Random(7)
    for _ in range(50):
        p = Policy("auto", min_samples=rng.randint(1, 5), alpha=rng.choice([0.1, 0.5, 1.0]))
        saved = period = 0.0
        active = False
        for n in range(1, 60):
            idle, build, wait = (rng.uniform(0, 5) * MS for _ in range(3))
            step = idle + build + wait + rng.uniform(1, 10) * MS
            p.measured(idle, build, wait, step)
            a = p.alpha if n > 1 else 1.0
            saved += a * (min(wait, idle + build) - saved)
            period += a * (step - period)
            if n >= p.min_samples:
                share = saved / period
                active = share >= p.on_share if not active else share >= p.off_share
            assert p.active == active
            assert p.saved_s == pytest.approx(saved) and p.period_s == pytest.approx(period)


async def test_the_executor_measures_its_decode_steps_for_auto(model) -> None:
    """A worker whose lookahead is "auto": its greedy decode steps that repeat are timed in
    parts; on this CPU a forward is all wait past its launch, so it turns on, and the
    lookahead's forwards are then taken. Tokens as without it; the pool's accounting holds.
    With a share no step can reach it measures and stays off."""
    async with started_system(model) as system:
        system.lookahead = "off"
        plain = await system.add_worker()
        system.lookahead = "default"
        auto_stub = await system.add_worker()
        never_stub = await system.add_worker()
        auto = system.workers[1].engine.executor
        never = system.workers[2].engine.executor
        auto.lookahead = Policy("auto", min_samples=3)
        never.lookahead = Policy("auto", min_samples=3, on_share=2.0)
        reqs = [request(list(range(5 + i, 40 + 3 * i)), max_tokens=24) for i in range(3)]
        want = await asyncio.gather(*(generate(plain, r) for r in reqs))
        for stub, executor in ((auto_stub, auto), (never_stub, never)):
            got = await asyncio.gather(*(generate(stub, r) for r in reqs))
            assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
            assert executor.lookahead.samples >= 3
        assert auto.lookahead.active and auto.lookahead.switches == 1
        assert auto.lookahead_hits > 5
        assert not never.lookahead.active and never.lookahead_hits == 0
        # GetInfo says so (the admin API, the CLI): the mode, whether it is taken, its steps.
        empty = pb.GetInfoRequest()
        on, off = await auto_stub.GetInfo(empty), await never_stub.GetInfo(empty)
        assert (on.decode_lookahead, on.decode_lookahead_active) == ("auto", True)
        assert on.lookahead_steps == auto.lookahead_hits
        assert (off.decode_lookahead, off.decode_lookahead_active, off.lookahead_steps) == (
            "auto",
            False,
            0,
        )
        cpu = await plain.GetInfo(empty)  # --decode-lookahead off
        assert (cpu.decode_lookahead, cpu.decode_lookahead_active) == ("off", False)
        await system.wait_idle()


def test_the_worker_flag_takes_auto_on_or_off(monkeypatch) -> None:
    from worker.config import LOOKAHEAD_MODES, WorkerConfig, check
    from worker.engine.lookahead import MODES

    assert LOOKAHEAD_MODES == MODES  # the flag's values are the policy's

    monkeypatch.delenv("KVWORKER_DECODE_LOOKAHEAD", raising=False)
    assert WorkerConfig.from_args([]).decode_lookahead == "auto"
    assert WorkerConfig.from_args(["--decode-lookahead", "on"]).decode_lookahead == "on"
    monkeypatch.setenv("KVWORKER_DECODE_LOOKAHEAD", "off")
    assert WorkerConfig.from_args([]).decode_lookahead == "off"
    assert "--decode-lookahead must be one of auto, on, off" in (
        check(WorkerConfig(decode_lookahead="yes")) or ""
    )
