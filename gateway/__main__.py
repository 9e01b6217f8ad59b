"""`python -m gateway`: run the gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.server import running
from gateway.tokenizer import Tokenizer
from kvserve_launch.run import Service, run_until_signal
from kvserve_launch.startup import ModelUnavailable, setting
from kvserve_model.torchless import keep_torch_out

keep_torch_out()  # before the tokenizer's transformers import (kvserve_model/torchless.py)
log = logging.getLogger("gateway")


def load_tokenizer(config: GatewayConfig) -> Tokenizer:
    try:
        return Tokenizer.load(config.model, config.max_model_len)
    except Exception as e:  # a bad --model should say so in one line, not a traceback
        raise ModelUnavailable(
            f"cannot load the tokenizer of {config.model!r}: {e}",
            f"set {setting(ENV_PREFIX, 'model')}",
        ) from e


def start(config: GatewayConfig) -> Service:
    """The gateway, its tokenizer loaded first (outside the event loop)."""
    return serving(config, load_tokenizer(config))


@contextlib.asynccontextmanager
async def serving(config: GatewayConfig, tokenizer: Tokenizer) -> AsyncIterator[str]:
    """The gateway, running; yields its ready line."""
    async with running(config, tokenizer) as gw:
        workers = gw.gateway.directory.views()
        log.info(
            "serving %s: HTTP on %s, gRPC on %s; cache service %s; %d worker(s) known",
            config.model_name,
            gw.http_address,
            gw.grpc_address,
            config.cache_service,
            len(workers),
        )
        yield f"GATEWAY_READY http={gw.http_address} grpc={gw.grpc_address}"


if __name__ == "__main__":
    cfg = GatewayConfig.from_args()
    run_until_signal("gateway", cfg.log_level, lambda: start(cfg))
