"""Builds a running worker: model on its thread, engine, gRPC server with health and reflection."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import mlx.core as mx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.engine import Engine, EngineLimits
from worker.executor import ModelExecutor
from worker.kv_pool import bytes_per_block
from worker.lease_client import LeaseClient, PoolRegistration
from worker.model_loader import LoadedModel, load_model
from worker.model_runner import ModelRunner
from worker.model_spec import probe
from worker.servicer import WorkerServicer

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


def _max_context(config: dict) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    text = config.get("text_config")
    return _max_context(text) if isinstance(text, dict) else 4096


def build_executor(config: WorkerConfig, loaded: LoadedModel) -> ModelExecutor:
    def build() -> ModelRunner:
        spec = probe(loaded.model)
        if config.num_blocks:
            return ModelRunner.create(
                loaded.model, block_size=config.block_size, num_blocks=config.num_blocks
            )
        per_block = bytes_per_block(spec.layers, config.block_size, spec.dtype)
        num_blocks = max(1, config.kv_memory_mb * 2**20 // per_block)
        return ModelRunner.create(loaded.model, block_size=config.block_size, num_blocks=num_blocks)

    return ModelExecutor(build)


@contextlib.asynccontextmanager
async def running(
    config: WorkerConfig, loaded: LoadedModel | None = None
) -> AsyncIterator[RunningWorker]:
    """Loads the model (unless given), binds the port, registers the pool, serves."""
    loaded = loaded or load_model(config.model)
    executor = build_executor(config, loaded)
    runner = executor.runner
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    worker_id = config.pool_id(port)
    address = config.address(port)
    layer = runner.spec.layers[0]
    registration = PoolRegistration(
        pool_id=worker_id,
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        model=config.model,
        model_fingerprint=loaded.fingerprint,
        worker_address=address,
        num_layers=len(runner.spec.layers),
        num_kv_heads=layer.n_kv_heads,
        head_dim=layer.k_head_dim,
        dtype=str(runner.spec.dtype),
    )
    limits = EngineLimits(
        max_batch_size=config.max_batch_size,
        max_step_tokens=config.max_step_tokens,
        max_context=_max_context(loaded.config),
        vocab_size=runner.spec.vocab_size,
        reserve_tokens=config.reserve_tokens,
        extend_ahead_tokens=config.extend_ahead_tokens,
        prefix_caching=config.prefix_caching,
    )
    engine = Engine(
        executor, LeaseClient(config.cache_service), registration, limits, loaded.tokenizer
    )
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(engine, worker_id, config.model), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    await engine.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker %s serving %s on %s: %d blocks of %d tokens (%s), device %s",
        worker_id,
        config.model,
        address,
        runner.num_blocks,
        runner.block_size,
        registration.dtype,
        mx.default_device(),
    )
    try:
        yield RunningWorker(server, engine, port, address, worker_id, loaded)
    finally:
        log.debug("stopping worker %s", worker_id)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        log.debug("server stopped")
        await engine.stop()
        log.debug("engine stopped")
        executor.shutdown()
        log.debug("worker %s stopped", worker_id)
