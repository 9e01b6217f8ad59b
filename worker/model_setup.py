"""The model side of a worker's start: the model thread with its runner and pool, and the limits
the engine runs with.

The config becomes plain values here, at the edge: the pool's size and step limits
(``worker.device_defaults``), the attention options, the warm-up's scratch blocks; the model
path (``worker.model``) is handed those and never reads the config. The runner is chosen by the
model: paged where every layer's state is per-token K/V, else the dense per-sequence runner; each
is self-checked against mlx-lm before the worker registers. Its log lines are the worker's
startup report (the pool, the runner, the attention path, the self-check).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from kvserve_launch.startup import ModelUnavailable, StartupError, setting
from kvserve_model.context import context_length
from kvserve_model.errors import ModelLoadError
from worker.config import ENV_PREFIX, WorkerConfig
from worker.device_defaults import (
    Device,
    WorkerLimits,
    choose_limits,
    dense_limits,
    device_kind,
    free_memory,
    total_memory,
)
from worker.engine import lookahead
from worker.engine.executor import ModelExecutor, Runner
from worker.engine.stall_watch import StallWatch, ping_interval, pings
from worker.errors import RecurrentStateError, UnsupportedModelError
from worker.group_launch import discard_hostfile
from worker.model import mlx_fixes
from worker.model.attention import AttentionOptions
from worker.model.dense_runner import DenseRunner, check_dense_parity, estimate_state
from worker.model.draft import DraftModel
from worker.model.group import Channel, GroupRunner, build_message, init_group, sharding
from worker.model.kv_pool import bytes_per_block
from worker.model.loader import LoadedModel, load_model
from worker.model.runner import ModelRunner
from worker.model.self_check import check_paged_parity
from worker.model.spec import ModelSpec, probe
from worker.warmup_plan import scratch_blocks

if TYPE_CHECKING:
    import mlx.nn as nn

log = logging.getLogger(__name__)


def attention_options(config: WorkerConfig) -> AttentionOptions:
    """The attention flags as the model path takes them (plain values); ``--cuda-sorted-gather``
    is a process-wide choice, made here, before the first runner."""
    if config.cuda_sorted_gather:
        mlx_fixes.keep_sorted_gathers()
    return AttentionOptions(
        backend=config.attention,
        streams=config.attention_streams,
        cpu_decode_kernel=config.cpu_decode_kernel,
        prefill_kernel=config.prefill_kernel,
        compile_decodes=config.compile_decodes,
    )


def build_executor(
    config: WorkerConfig,
    loaded: LoadedModel,
    self_checked: Callable[[], None] | None = None,
) -> tuple[ModelExecutor, WorkerLimits]:
    """The model thread with its runner and pool, and the limits the engine runs with: flags
    where set, else the device's defaults (``worker.device_defaults``), sized on the model
    thread once the weights are in memory. Unless ``config.self_check`` is off, the paged path
    is checked against mlx-lm's dense path first (``worker.model.self_check``); a model that fails
    raises UnsupportedModelError.

    A model whose layers keep recurrent state (``probe`` raises RecurrentStateError) gets the
    dense per-sequence runner instead (``worker.model.dense_runner``), checked the same way.
    ``self_checked`` runs on the model thread once the runner is built and checked
    (``worker.precompile.finish``: the children that compiled kernels beside the self-check
    are no longer needed)."""
    chosen: list[WorkerLimits] = []

    def build() -> Runner:
        group = _join_group(config, loaded)
        try:
            spec = probe(loaded.model)
        except RecurrentStateError as e:
            if group is not None:
                raise UnsupportedModelError(
                    f"a model with recurrent state runs on one rank, not a group ({e})"
                ) from e
            log.info("not pageable (%s): serving with one dense mlx-lm cache per sequence", e)
            runner, limits = _dense_runner(config, loaded)
        else:
            runner, limits = _paged_runner(config, loaded, spec, group)
        chosen.append(limits)
        if self_checked is not None:
            self_checked()
        return runner

    executor = ModelExecutor(build, _draft_builder(config, loaded))
    # A group's other ranks cannot run a forward on tokens not sampled yet.
    mode = config.decode_lookahead if config.tensor_parallel == 1 else "off"
    executor.lookahead = lookahead.Policy.for_device(mode, mx.default_device() == mx.gpu)
    if config.tensor_parallel > 1 and config.group_timeout_s > 0:
        executor.watch = StallWatch(config.group_timeout_s, "worker group")
        runner = cast(Any, executor.runner)
        pings(executor.submit, runner.ping, ping_interval(config.group_timeout_s))
    return executor, chosen[0]


def group_sharding(config: WorkerConfig) -> Callable[[nn.Module], None] | None:
    """For ``load_model``: with ``--tensor-parallel N``, join the group (as rank 0: the other
    ranks were started by ``worker.group_launch``) and shard the model as it loads; None for
    one process."""
    if config.tensor_parallel == 1:
        return None
    return sharding(group_backend(config))


def group_backend(config: WorkerConfig) -> str:
    return os.environ.get("KVSERVE_GROUP_BACKEND", config.group_backend)


def _join_group(config: WorkerConfig, loaded: LoadedModel) -> Channel | None:
    """With ``--tensor-parallel N``: the group this process is rank 0 of, its model sharded as
    it loaded (``group_sharding``); None for one process."""
    if config.tensor_parallel == 1:
        return None
    group = init_group(group_backend(config))
    if group.size() != config.tensor_parallel or group.rank() != 0:
        raise UnsupportedModelError(
            f"--tensor-parallel {config.tensor_parallel}: this process is rank {group.rank()} "
            f"of {group.size()} (rank 0 of {config.tensor_parallel} expected)"
        )
    log.info("model sharded over %d ranks (mlx-lm's shard())", group.size())
    return Channel(group)


def _fitting(limits: WorkerLimits, bytes_per_block: int, device: Device) -> WorkerLimits:
    """``limits``, once its pool fits in the device's whole memory (``total_memory``); a
    StartupError naming both otherwise. ``--num-blocks 1000000000`` asked for a 1.4 PB pool,
    which the worker tried to make and died of SIGSEGV (the launcher then blamed the BLAS)."""
    total = total_memory(device)
    need = (limits.num_blocks + limits.scratch_blocks) * bytes_per_block
    if total is not None and need > total:
        raise StartupError(
            f"a KV pool of {limits.num_blocks} blocks ({limits.pool_source}) needs "
            f"{need / 2**30:,.1f} GiB, more than this {device}'s {total / 2**30:,.1f} GiB of "
            "memory",
            "set a smaller --num-blocks or --kv-memory-mb, or leave both unset",
        )
    return limits


def _with_scratch(config: WorkerConfig, loaded: LoadedModel, limits: WorkerLimits) -> WorkerLimits:
    """The warm-up's private blocks on top of the pool (none without a warm-up)."""
    if not config.warmup:
        return limits
    scratch = scratch_blocks(
        block_size=config.block_size,
        num_blocks=limits.num_blocks,
        max_batch_size=limits.max_batch_size,
        max_step_tokens=limits.max_step_tokens,
        max_context=context_length(loaded.config),
        draft_tokens=config.num_draft_tokens,
    )
    return replace(limits, scratch_blocks=scratch)


def _paged_runner(
    config: WorkerConfig, loaded: LoadedModel, spec: ModelSpec, group: Channel | None = None
) -> tuple[Runner, WorkerLimits]:
    """The paged runner over a pool sized for ``spec``'s K/V, self-checked (model thread); in
    a group (``group``: its channel, on rank 0) every rank builds the same and is checked
    with it."""
    per_block = bytes_per_block(spec.layers, config.block_size, spec.dtype)
    device = device_kind()
    limits = _with_scratch(
        config, loaded, choose_limits(device, free_memory(device), per_block, config)
    )
    limits = _fitting(limits, per_block, device)
    log.info("%s", limits.describe(config.block_size, per_block))
    built: dict[str, Any] = {
        "block_size": config.block_size,
        "num_blocks": limits.num_blocks + limits.scratch_blocks,
        "attention": attention_options(config),
    }
    plain = ModelRunner.create(loaded.model, **built)
    runner: Any = plain
    if group is not None:  # the other ranks build theirs from this message
        group.send(build_message(str(loaded.path), config.dequantize, **built))
        discard_hostfile()  # every rank has joined: the first message reached them all
        runner = GroupRunner(plain, group)
    log.info("%s", runner.describe())
    log.info("%s", runner.choose_decode_attention().describe())
    if config.self_check:
        # Before registering: no lease exists yet, so the pool's blocks are free to write.
        # After the decode path is chosen: the check runs the path the worker will serve.
        if group is not None:
            result = runner.self_check()
        else:
            result = check_paged_parity(loaded.model, runner=plain)
        log.info("%s", result.describe())
        result.raise_if_failed()
    return cast(Runner, runner), limits


def _dense_runner(config: WorkerConfig, loaded: LoadedModel) -> tuple[Runner, WorkerLimits]:
    """The dense per-sequence runner of a model with recurrent state, self-checked (model
    thread)."""
    try:
        estimate = estimate_state(loaded.model)
    except Exception as e:  # the model's own forward failed on one token, of any type
        raise UnsupportedModelError(f"a one-token forward failed: {e}") from e
    device = device_kind()
    max_context = context_length(loaded.config)
    free = free_memory(device)
    limits = _with_scratch(
        config, loaded, dense_limits(estimate.bytes_per_token, device, free, config, max_context)
    )
    per_block = max(1, config.block_size * estimate.bytes_per_token)
    if estimate.bytes_per_token:  # else blocks count tokens that cost no memory
        limits = _fitting(limits, per_block, device)
    log.info("%s", limits.describe(config.block_size, per_block))
    runner = DenseRunner(
        loaded.model,
        estimate,
        block_size=config.block_size,
        num_blocks=limits.num_blocks + limits.scratch_blocks,
    )
    if config.self_check:
        result = check_dense_parity(loaded.model, runner)
        log.info("%s", result.describe())
        result.raise_if_failed()
    state = estimate.bytes_per_sequence * limits.max_batch_size
    log.info(
        "%s; up to %d sequences' recurrent state: %.1f MiB outside the KV budget",
        runner.describe(),
        limits.max_batch_size,
        state / 2**20,
    )
    return runner, limits


def _draft_builder(
    config: WorkerConfig, loaded: LoadedModel
) -> Callable[[Runner], DraftModel] | None:
    """``--draft-model``, loaded now and checked against the served model's tokenizer; what
    builds its draft model for a runner on the model thread (None: no draft model)."""
    if not config.draft_model:
        return None
    draft = load_model(config.draft_model, dequantize=config.dequantize)
    if draft.tokenizer.vocab_size != loaded.tokenizer.vocab_size:
        raise UnsupportedModelError(
            f"draft model {config.draft_model}: its tokenizer has {draft.tokenizer.vocab_size}"
            f" tokens, the served model's {loaded.tokenizer.vocab_size}; a draft model must "
            "share the served model's tokenizer"
        )

    def build_draft(runner: Runner) -> DraftModel:
        if runner.kind != "paged":
            raise UnsupportedModelError(
                "--draft-model needs the paged runner (recurrent layers cannot roll "
                "rejected drafts back)"
            )
        return DraftModel(draft.model, config.draft_model, runner.spec.vocab_size)

    return build_draft


@contextlib.contextmanager
def model_errors_as_startup_errors(model: str) -> Iterator[None]:
    """The worker's errors about its model, as the one startup failure they all are."""
    hint = f"set {setting(ENV_PREFIX, 'model')}"
    try:
        yield
    except ModelLoadError as e:
        raise ModelUnavailable(str(e), hint) from e
    except UnsupportedModelError as e:
        raise ModelUnavailable(f"{model} cannot be served from a paged KV cache: {e}", hint) from e
