"""Every mlx-lm model family is served correctly or refused at startup.

Each family of the installed mlx-lm (``tests.worker.families``) is built tiny and classified. A
``paged`` family must match dense per-sequence mlx-lm on batched paged forwards
(``tests.worker.sweep``: max |logit diff| <= 1e-4 in fp32, identical greedy tokens), or be
refused at startup by ``worker.model.self_check``; a recurrent one is served by the dense per-sequence
runner and must pass its startup check against one-shot mlx-lm (``check_dense_parity``: chunked
prefill and decode, fp32 tolerance 1e-3); an otherwise unsupported one must be refused when its
runner is built. The default run uses the fast composite scenario (all families,
about 30 s on 2 cores); ``pytest -m sweep`` adds every scenario with more decode steps, as
``scripts/model_sweep.py`` runs to write docs/models.md.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.worker import families, sweep
from worker.errors import RecurrentStateError, UnsupportedModelError
from worker.model.attention import cpu_decode
from worker.model.dense_runner import DenseRunner, check_dense_parity, estimate_state
from worker.model.runner import ModelRunner
from worker.model.self_check import SelfCheckResult, check_paged_parity
from worker.model.spec import probe

# Families that fail parity and that the startup self-check does not refuse: served wrong today.
# Families that fail parity and are not refused yet, each with its reason; empty: none is served
# wrong. (plamo3 was, until the probe refused sliding windows wider than mlx-lm's own cache.)
KNOWN_FAILING: dict[str, str] = {}

FAMILIES = families.families()


@functools.cache
def _classified(family: str) -> families.Classified:
    return families.classify(family)


@functools.cache
def _parity(family: str, full: bool, decode: str = "blocks") -> sweep.Parity:
    model = _classified(family).model
    assert model is not None
    scenarios, steps = (sweep.FULL, 6) if full else (sweep.FAST, 2)
    return sweep.run_parity(model, scenarios, steps, decode)


@functools.cache
def _refused(family: str) -> str:
    """Why the worker refuses ``family`` at startup; "" if it serves it."""
    model = _classified(family).model
    if model is None:
        return "not buildable"
    try:
        ModelRunner.create(model, block_size=sweep.BS, num_blocks=8)
    except Exception as e:  # UnsupportedModelError, or a probe that crashes: not served either way
        return f"{type(e).__name__}: {e}"
    check = check_paged_parity(model)
    return "" if check.ok else check.reason


@functools.cache
def _dense_check(family: str) -> SelfCheckResult:
    """The dense runner's startup check of a recurrent family, as the worker runs it."""
    model = _classified(family).model
    assert model is not None
    with pytest.raises(RecurrentStateError):  # what sends the worker to the dense runner
        probe(model)
    runner = DenseRunner(model, estimate_state(model), block_size=sweep.BS, num_blocks=8)
    return check_dense_parity(model, runner)


def _params(ids: tuple[str, ...]) -> list:
    return [
        pytest.param(
            f,
            id=f,
            marks=[pytest.mark.xfail(reason=KNOWN_FAILING[f], strict=False)]
            if f in KNOWN_FAILING
            else [],
        )
        for f in ids
    ]


def _served_wrong(family: str, full: bool) -> str:
    """ "" if ``family`` is served right or refused; else what is wrong."""
    kind = _classified(family).kind
    if kind == "recurrent":
        check = _dense_check(family)
        return "" if check.ok else f"dense runner: {check.reason}"
    if kind != "paged":
        return "" if _refused(family) else "not paged, yet the worker serves it"
    parity = _parity(family, full)
    if parity.passed or _refused(family):
        return ""
    return (
        f"max |logit diff| {parity.max_diff:.2e} (tolerance {sweep.TOL}), "
        f"token mismatches {list(parity.mismatches[:3])}, error {parity.error!r}"
    )


@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_served_right_or_refused(family):
    c = _classified(family)
    if c.kind == "paged" and family not in families.GREEDY_COLLAPSES:
        assert sweep.context_sensitive(c.model), "greedy output ignores the context: no test"
    assert not _served_wrong(family, full=False)


@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_decodes_by_the_cpu_kernel(family):
    """The compiled CPU decode kernel (``worker.model.cpu_decode``, what the worker's start-up
    measurement picks on most CPUs) matches dense mlx-lm for every family served paged."""
    if _classified(family).kind != "paged" or _refused(family):
        pytest.skip("not served paged")
    if not cpu_decode.available():
        pytest.skip("numba is not installed")
    if mx.default_device() == mx.gpu:
        pytest.skip("the CPU kernel serves the CPU: a GPU's attention takes its own route")
    parity = _parity(family, False, "kernel")
    assert parity.passed, (parity.max_diff, parity.mismatches[:3], parity.error)


@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_on_the_gpu_attention_paths(family):
    """Attention routed as on an NVIDIA GPU (decodes to the block-table kernel; prefill
    chunks to the block-table prefill kernel, or once their shapes recur to one causal call
    per context, ``cuda.exact_context_attention``; the kernels' float64 reference
    standing in) matches dense mlx-lm for every paged family."""
    if _classified(family).kind != "paged" or _refused(family):
        pytest.skip("not served paged")
    parity = _parity(family, False, "gpu")
    assert parity.passed, (parity.max_diff, parity.mismatches[:3], parity.error)


@functools.cache
def _quantized_parity(family: str, bits: int, full: bool) -> sweep.Parity:
    """``family``'s tiny model quantized as mlx-community checkpoints are (affine, group 32,
    every linear and embedding layer whose rows are whole groups) against dense mlx-lm on the
    same quantized model."""
    model = families.build(family)
    nn.quantize(
        model,
        group_size=32,
        bits=bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    mx.eval(model.parameters())
    scenarios, steps = (sweep.FULL, 6) if full else (sweep.FAST, 2)
    return sweep.run_parity(model, scenarios, steps, "blocks")


@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_quantized_4bit(family):
    """Most checkpoints users run are 4-bit: every paged family, quantized, on the paged path."""
    if _classified(family).kind != "paged" or _refused(family):
        pytest.skip("not served paged")
    parity = _quantized_parity(family, 4, full=False)
    assert parity.passed, (parity.max_diff, parity.mismatches[:3], parity.error)


@pytest.mark.sweep
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_quantized_full_sweep(family, bits):
    if _classified(family).kind != "paged" or _refused(family):
        pytest.skip("not served paged")
    parity = _quantized_parity(family, bits, full=True)
    assert parity.passed, (parity.max_diff, parity.mismatches[:3], parity.error)


@pytest.mark.sweep
@pytest.mark.parametrize("family", _params(FAMILIES))
def test_family_full_sweep(family):
    if _classified(family).kind != "paged":
        pytest.skip(f"{_classified(family).kind}: {_classified(family).reason}")
    assert not _served_wrong(family, full=True)


def test_no_family_served_wrong():
    """The families that fail parity and are not refused, listed: any outside KNOWN_FAILING fails
    the suite; those in it are reported as an expected failure, never hidden."""
    wrong = {f: why for f in FAMILIES if (why := _served_wrong(f, full=False))}
    unknown = {f: why for f, why in wrong.items() if f not in KNOWN_FAILING}
    assert not unknown, f"served wrong and not refused: {unknown}"
    if wrong:
        pytest.xfail(f"KNOWN_FAILING, served wrong and not refused: {sorted(wrong)}")


def test_classes_cover_every_family():
    kinds = {f: _classified(f).kind for f in FAMILIES}
    assert set(kinds.values()) <= set(families.CLASSES)
    assert all(_classified(f).reason for f in FAMILIES if kinds[f] != "paged")
    # A family that does not build tiny is listed with its reason, not lost to a missing field.
    unbuilt = [f for f in FAMILIES if _classified(f).reason.startswith("cannot build tiny")]
    assert not unbuilt, f"add overrides in tests/worker/families.py for {unbuilt}"


def test_a_window_wider_than_mlx_lms_own_cache_is_refused():
    """plamo3 masks window_size + 1 keys with a cache of window_size: mlx-lm's output depends
    on chunking there, so the probe refuses it instead of serving something different."""
    if "plamo3" not in FAMILIES:
        pytest.skip("this mlx-lm has no plamo3")
    model = families.build("plamo3")
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        probe(model)


def test_a_forward_that_needs_more_than_the_cache_protocol_is_refused_cleanly():
    """afm7's KV-reuse layers call cache.keys_and_values(): the probe answers with one
    UnsupportedModelError (a one-line startup failure), not an AttributeError traceback."""
    if "afm7" not in FAMILIES:
        pytest.skip("this mlx-lm has no afm7")
    with pytest.raises(UnsupportedModelError, match="forward fails on a paged cache"):
        probe(families.build("afm7"))
