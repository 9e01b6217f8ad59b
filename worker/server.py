"""Builds a running worker: model on its thread, engine, gRPC server with health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace

import grpc
import mlx.core as mx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve_launch.malformed import MalformedRequests
from kvserve_launch.startup import EXCLUSIVE_PORT, ModelUnavailable, add_port, setting
from kvserve_launch.tls import Dialer, server_credentials
from kvserve_model.context import context_length
from kvserve_model.errors import ModelLoadError
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.config import ENV_PREFIX, WorkerConfig
from worker.device_defaults import (
    WorkerLimits,
    choose_limits,
    dense_limits,
    device_kind,
    free_memory,
)
from worker.engine.executor import ModelExecutor, Runner
from worker.engine.lease import PoolRegistration
from worker.engine.loop import Engine, EngineLimits
from worker.errors import RecurrentStateError, UnsupportedModelError
from worker.lease_client import LeaseClient
from worker.model import mlx_fixes
from worker.model.attention import AttentionOptions
from worker.model.dense_runner import DenseRunner, check_dense_parity, estimate_state
from worker.model.draft import DraftModel
from worker.model.kv_pool import bytes_per_block
from worker.model.loader import LoadedModel, load_model
from worker.model.runner import ModelRunner
from worker.model.self_check import check_paged_parity
from worker.model.spec import LayerSpec, probe
from worker.servicer import WorkerServicer
from worker.warmup import scratch_blocks, warm_up

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass
class RunningWorker:
    server: grpc.aio.Server
    engine: Engine
    port: int
    address: str
    worker_id: str
    loaded: LoadedModel
    # The background warm-up (None when --no-warmup): done once every shape has run.
    warming: asyncio.Task[None] | None = None


async def _warm_up_in_background(
    engine: Engine, limits: WorkerLimits, max_context: int, draft_tokens: int
) -> None:
    """The warm-up (``worker.warmup``) on the scratch blocks, between requests. A failure is
    logged, not raised: the self-check has shown the model serves; a shape the warm-up could
    not run costs its first request a compile, nothing more."""
    try:
        report = await warm_up(
            engine.executor,
            engine.tokenizer,
            max_batch_size=limits.max_batch_size,
            max_step_tokens=limits.max_step_tokens,
            max_context=max_context,
            draft_tokens=draft_tokens,
            first_block=limits.num_blocks,
            num_blocks=limits.scratch_blocks,
            gate=engine.idle_step,
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("warm-up failed; requests will compile what it did not reach")
        return
    log.info("%s", report.describe())


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
    kernels_ready: Callable[[], None] | None = None,
) -> tuple[ModelExecutor, WorkerLimits]:
    """The model thread with its runner and pool, and the limits the engine runs with: flags
    where set, else the device's defaults (``worker.device_defaults``), sized on the model
    thread once the weights are in memory. Unless ``config.self_check`` is off, the paged path
    is checked against mlx-lm's dense path first (``worker.model.self_check``); a model that fails
    raises UnsupportedModelError.

    A model whose layers keep recurrent state (``probe`` raises RecurrentStateError) gets the
    dense per-sequence runner instead (``worker.model.dense_runner``), checked the same way.
    ``kernels_ready`` runs first on the model thread (``worker.precompile.finish``: the
    kernels a child process compiled meanwhile, put where MLX finds them)."""
    chosen: list[WorkerLimits] = []

    def with_scratch(limits: WorkerLimits) -> WorkerLimits:
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

    def build() -> Runner:
        if kernels_ready is not None:
            kernels_ready()
        try:
            spec = probe(loaded.model)
        except RecurrentStateError as e:
            log.info("not pageable (%s): serving with one dense mlx-lm cache per sequence", e)
            return build_dense()
        per_block = bytes_per_block(spec.layers, config.block_size, spec.dtype)
        device = device_kind()
        limits = with_scratch(choose_limits(device, free_memory(device), per_block, config))
        log.info("%s", limits.describe(config.block_size, per_block))
        chosen.append(limits)
        runner = ModelRunner.create(
            loaded.model,
            block_size=config.block_size,
            num_blocks=limits.num_blocks + limits.scratch_blocks,
            attention=attention_options(config),
        )
        log.info("%s", runner.describe())
        log.info("%s", runner.choose_decode_attention().describe())
        if config.self_check:
            # Before registering: no lease exists yet, so the pool's blocks are free to write.
            # After the decode path is chosen: the check runs the path the worker will serve.
            result = check_paged_parity(loaded.model, runner=runner)
            log.info("%s", result.describe())
            result.raise_if_failed()
        return runner

    def build_dense() -> Runner:
        try:
            estimate = estimate_state(loaded.model)
        except Exception as e:  # the model's own forward failed on one token, of any type
            raise UnsupportedModelError(f"a one-token forward failed: {e}") from e
        device = device_kind()
        limits = with_scratch(
            dense_limits(
                estimate.bytes_per_token,
                device,
                free_memory(device),
                config,
                context_length(loaded.config),
            )
        )
        per_block = max(1, config.block_size * estimate.bytes_per_token)
        log.info("%s", limits.describe(config.block_size, per_block))
        chosen.append(limits)
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
        return runner

    build_draft = None
    if config.draft_model:
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

    executor = ModelExecutor(build, build_draft)
    executor.lookahead = config.decode_lookahead
    return executor, chosen[0]


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


@contextlib.asynccontextmanager
async def running(
    config: WorkerConfig,
    loaded: LoadedModel | None = None,
    kernels_ready: Callable[[], None] | None = None,
) -> AsyncIterator[RunningWorker]:
    """Loads the model (unless given), binds the port, registers the pool, serves. Raises
    StartupError (``kvserve_launch.startup``) for a model it cannot serve or a port it cannot
    bind. ``kernels_ready``: see :func:`build_executor`."""
    with model_errors_as_startup_errors(config.model):
        loaded = loaded or load_model(config.model, dequantize=config.dequantize)
        executor, chosen = build_executor(config, loaded, kernels_ready)
    runner = executor.runner
    server = grpc.aio.server(
        interceptors=[MalformedRequests()],
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), EXCLUSIVE_PORT],
    )
    tls = server_credentials(config.tls_cert, config.tls_key, ENV_PREFIX, config.tls_client_ca)
    dialer = Dialer.from_files(
        config.tls_ca, config.tls_server_name, config.tls_cert, config.tls_key, ENV_PREFIX
    )
    port = add_port(server, config.host, config.port, ENV_PREFIX, "port", tls)
    worker_id = config.pool_id(port)
    address = config.address(port)
    # A pure SSM has no attention layer: its pool layout is all zeros (the cache service only
    # records it).
    layer = runner.spec.layers[0] if runner.spec.layers else LayerSpec(0, 0, 0)
    dense = runner.kind == "dense"
    registration = PoolRegistration(
        pool_id=worker_id,
        num_blocks=chosen.num_blocks,  # not the warm-up's scratch blocks: no lease gets them
        block_size=runner.block_size,
        model=config.model,
        model_fingerprint=loaded.fingerprint,
        worker_address=address,
        num_layers=len(runner.spec.layers),
        num_kv_heads=layer.n_kv_heads,
        head_dim=layer.k_head_dim,
        dtype=str(runner.spec.dtype),
        bytes_per_block=runner.bytes_per_block,
    )
    max_context = context_length(loaded.config)
    limits = EngineLimits(
        max_batch_size=chosen.max_batch_size,
        max_step_tokens=chosen.max_step_tokens,
        max_pending_requests=chosen.max_pending_requests,
        max_context=max_context,
        vocab_size=runner.spec.vocab_size,
        reserve_tokens=config.reserve_tokens,
        extend_ahead_tokens=config.extend_ahead_tokens,
        # The dense runner's blocks hold no K/V: no prefix to match or to publish.
        prefix_caching=config.prefix_caching and not dense,
        publish_blocks=not dense,
        num_draft_tokens=config.num_draft_tokens,
        speculation=not dense,
        draft_model=config.draft_model if executor.draft is not None else "",
        admission_timeout_s=config.admission_timeout_s,
        cache_outage_timeout_s=config.cache_outage_timeout_s,
    )
    engine = Engine(
        executor,
        LeaseClient(
            config.cache_service,
            config.cache_token,
            dialer.aio(config.cache_service),
        ),
        registration,
        limits,
        loaded.tokenizer,
    )
    pb_grpc.add_WorkerServicer_to_server(
        WorkerServicer(engine, worker_id, config.model, runner.kind, config.stream_interval),
        server,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    await engine.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker %s serving %s on %s: %d blocks of %d tokens (%s), device %s, %s runner",
        worker_id,
        config.model,
        address,
        runner.num_blocks,
        runner.block_size,
        registration.dtype,
        mx.default_device(),
        runner.kind,
    )
    warming = None
    if config.warmup:
        warming = asyncio.create_task(
            _warm_up_in_background(engine, chosen, max_context, config.num_draft_tokens)
        )
    try:
        yield RunningWorker(server, engine, port, address, worker_id, loaded, warming)
    finally:
        log.debug("stopping worker %s", worker_id)
        if warming is not None:
            warming.cancel()
            await asyncio.gather(warming, return_exceptions=True)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        log.debug("server stopped")
        await engine.stop()
        log.debug("engine stopped")
        executor.shutdown()
        log.debug("worker %s stopped", worker_id)
