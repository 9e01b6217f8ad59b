"""The startup self-check: the paged path against mlx-lm's dense path on one small batch.

A worker refuses, with a one-line reason, a model whose paged path gives other logits than
mlx-lm's own; here the paged path is broken on purpose (padding left unmasked, or gemma2's
masks in the 4-D layout it had before ``ModelSpec.mask_rank``) to show that the check notices.
"""

from __future__ import annotations

import logging

import pytest

from kvserve_launch.startup import ModelUnavailable
from kvserve_model.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from tests.worker.helpers import FAMILIES, TOL, tiny_model
from worker.config import WorkerConfig
from worker.model import runner as runner_module
from worker.model import spec as model_spec
from worker.model.attention import AttentionBackend
from worker.model.forward_batch import ForwardBatch
from worker.model.loader import LoadedModel, load_model
from worker.model.runner import ModelRunner
from worker.model.self_check import check_paged_parity
from worker.model_setup import build_executor
from worker.server import running


@pytest.fixture(scope="module")
def default_model(tmp_path_factory) -> LoadedModel:
    path = ensure_tiny_model(tmp_path_factory.mktemp("models") / TINY_MODEL_NAME, log=print)
    return load_model(str(path))


def _ignore_padding(monkeypatch) -> None:
    """A paged path that forgets its padding: the mask a batch of equal sequences would get.
    On an NVIDIA GPU the block-table kernel, which computes its masks from positions, would
    serve every forward of the check correctly even so: it is switched off, so that the GPU
    takes the masked path this breaks: runners take the reference backend."""
    monkeypatch.setattr(runner_module, "choose_backend", lambda options=None: AttentionBackend())
    monkeypatch.setattr(
        ForwardBatch,
        "_build_mask",
        lambda self, window_size, return_array: None if self.query_len == 1 else "causal",
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_test_family_passes(family):
    result = check_paged_parity(tiny_model(family))
    assert result.ok and result.max_diff <= TOL, result.describe()


def test_unmasked_padding_is_caught():
    model = tiny_model("llama")
    assert check_paged_parity(model).ok
    with pytest.MonkeyPatch.context() as m:
        _ignore_padding(m)
        result = check_paged_parity(model)
    assert not result.ok and result.max_diff > 1.0
    assert "differ from mlx-lm's dense path by" in result.reason


@pytest.mark.parametrize("family", ["gemma2", "gemma2_kv1"])
def test_gemma2_with_4d_masks_is_caught(family, monkeypatch):
    """What gemma2 got before: 3 sequences against 2 kv heads fail to broadcast, against 1 kv
    head the scores grow a second batch axis and a reshape fails."""
    monkeypatch.setattr(model_spec, "mask_rank", lambda *args: 4)
    result = check_paged_parity(tiny_model(family))
    assert not result.ok
    assert result.reason.startswith("the paged self-check forward failed: ValueError: [")
    assert "\n" not in result.reason


def test_the_default_model_passes_at_startup(default_model, caplog):
    caplog.set_level(logging.INFO, logger="worker.model_setup")
    executor, _ = build_executor(WorkerConfig(num_blocks=64), default_model)
    executor.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert line.startswith("self-check passed:") and "max logit diff" in line, line


async def test_a_broken_paged_path_is_refused_at_startup(default_model, monkeypatch):
    _ignore_padding(monkeypatch)
    config = WorkerConfig(model=str(default_model.path), port=0, num_blocks=64)
    with pytest.raises(ModelUnavailable) as e:
        async with running(config, default_model):
            pass
    line = e.value.line("worker")
    assert "\n" not in line
    assert "cannot be served from a paged KV cache: the paged path's logits differ" in line


def test_the_check_can_be_turned_off(default_model, monkeypatch):
    _ignore_padding(monkeypatch)
    executor, _ = build_executor(WorkerConfig(num_blocks=64, self_check=False), default_model)
    executor.shutdown()
    monkeypatch.setenv("KVWORKER_SELF_CHECK", "0")
    assert not WorkerConfig.from_args([]).self_check
    assert WorkerConfig.from_args(["--self-check"]).self_check
    monkeypatch.delenv("KVWORKER_SELF_CHECK")
    assert WorkerConfig.from_args([]).self_check
    assert not WorkerConfig.from_args(["--no-self-check"]).self_check


def test_a_pool_too_small_for_the_batch_gets_one_of_its_own():
    model = tiny_model("qwen2")
    runner = ModelRunner.create(model, block_size=4, num_blocks=3)
    result = check_paged_parity(model, runner=runner)
    assert result.ok and result.max_diff <= TOL


def test_a_model_that_needs_int_offsets_runs_one_forward_per_position():
    """gpt_bigcode builds positions with np.arange(cache.offset, ...): the probe finds it needs
    one int offset, and batches of sequences at different positions run as separate forwards,
    matching dense mlx-lm (it was refused by this self-check before)."""
    from tests.worker import families
    from worker.model.spec import probe

    if "gpt_bigcode" not in families.families():
        pytest.skip("this mlx-lm has no gpt_bigcode")
    model = families.build("gpt_bigcode")
    assert probe(model).int_offsets
    assert not probe(tiny_model("llama")).int_offsets
    result = check_paged_parity(model)
    assert result.ok and result.max_diff <= TOL, result.describe()


def test_fp32_run_as_tf32_gets_the_tolerance_of_its_mantissa(monkeypatch):
    """On an H100 the default model's paged and dense fp32 logits differed by 0.0061 (0.0086 in
    another run) with MLX's default TF32 matmuls, and by 6e-6 with MLX_ENABLE_TF32=0: the fp32
    tolerance (1e-3) refused the default model on every GPU. fp32 run as TF32 is held to
    fp16's tolerance (the same 10-bit mantissa); a broken mask still differs by whole units."""
    import mlx.core as mx

    from worker.model import self_check

    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)  # MLX's default (tests/conftest sets 0)
    monkeypatch.setattr(self_check.mx, "default_device", lambda: mx.cpu)
    assert not self_check.tf32_matmuls()  # CPU: real fp32
    assert self_check.tolerance_for(mx.float32, 8.0) == self_check.FP32_TOLERANCE
    monkeypatch.setattr(self_check.mx, "default_device", lambda: mx.gpu)
    assert self_check.tf32_matmuls()
    assert self_check.tolerance_for(mx.float32, 8.0) == self_check.tolerance_for(mx.float16, 8.0)
    assert 0.0086 < self_check.tolerance_for(mx.float32, 1.0) < 1.0
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert self_check.tolerance_for(mx.float32, 8.0) == self_check.FP32_TOLERANCE
