"""`python -m gateway`: run the gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.server import running
from gateway.tokenizer import Tokenizer
from kvserve_launch.startup import ModelUnavailable, StartupError, report, setting

log = logging.getLogger("gateway")


def load_tokenizer(config: GatewayConfig) -> Tokenizer:
    try:
        return Tokenizer.load(config.model, config.max_model_len)
    except Exception as e:  # a bad --model should say so in one line, not a traceback
        raise ModelUnavailable(
            f"cannot load the tokenizer of {config.model!r}: {e}",
            f"set {setting(ENV_PREFIX, 'model')}",
        ) from e


async def main(config: GatewayConfig, tokenizer: Tokenizer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
        # A line launchers and tests wait for.
        print(f"GATEWAY_READY http={gw.http_address} grpc={gw.grpc_address}", flush=True)
        await stop.wait()
        log.info("shutting down")


if __name__ == "__main__":
    cfg = GatewayConfig.from_args()
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(main(cfg, load_tokenizer(cfg)))
    except StartupError as e:
        sys.exit(report("gateway", e))
