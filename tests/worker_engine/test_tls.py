"""TLS from config: the cache service, a worker reaching it, and the gateway's HTTP port, with
a CA and certificates this test makes with the openssl CLI."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.server import running as gateway_running
from gateway.tokenizer import Tokenizer
from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as cache_running
from kvserve_launch.startup import StartupError
from kvserve_launch.tls import channel
from tests.tls_certs import Certs, make_certs, needs_openssl
from tests.worker_engine.conftest import generate, request, started_system
from worker.model.loader import LoadedModel

pytestmark = needs_openssl


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


async def _check_health(ch: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(ch)
    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_cache_service_serves_tls_to_clients_that_trust_its_ca(certs: Certs) -> None:
    config = ServiceConfig(port=0, tls_cert=certs.cert, tls_key=certs.key)
    async with cache_running(config) as svc:
        async with channel(svc.address, certs.ca) as ch:
            await _check_health(ch)
        # The name in the certificate, not the address dialed.
        async with channel(f"localhost:{svc.port}", certs.ca, "localhost") as ch:
            await _check_health(ch)
        for ch in (
            grpc.aio.insecure_channel(svc.address),  # plaintext to a TLS port
            channel(svc.address, certs.other_ca),  # a CA that did not sign its certificate
            channel(svc.address, certs.ca, "not-the-server"),  # a name it does not carry
        ):
            async with ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _check_health(ch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_plaintext_service_is_the_default(certs: Certs) -> None:
    async with cache_running(ServiceConfig(port=0)) as svc, channel(svc.address) as ch:
        await _check_health(ch)


async def test_unreadable_pem_is_a_startup_error(certs: Certs, tmp_path: Path) -> None:
    config = ServiceConfig(port=0, tls_cert=str(tmp_path / "missing.pem"), tls_key=certs.key)
    with pytest.raises(StartupError, match=r"missing\.pem") as err:
        async with cache_running(config):
            pass
    assert "--tls-cert or KVCACHE_TLS_CERT" in err.value.line("kvcache")


def test_cert_without_key_is_refused() -> None:
    with pytest.raises(SystemExit):
        ServiceConfig.from_args(["--tls-cert", "a.pem"])
    config = ServiceConfig.from_args(["--tls-cert", "a.pem", "--tls-key", "a.key"])
    assert (config.tls_cert, config.tls_key) == ("a.pem", "a.key")


async def test_worker_reaches_a_tls_cache_service(
    certs: Certs, model: LoadedModel, reference
) -> None:
    """A worker with the CA registers, leases and generates as over plaintext; its own gRPC
    port serves TLS too."""
    tls = {"tls_cert": certs.cert, "tls_key": certs.key}
    async with started_system(model, tls_ca=certs.ca, **tls) as system:
        await system.add_worker(tls_ca=certs.ca)  # a plaintext worker port
        prompt = list(range(3, 40))
        got = await generate(system.stubs[0], request(prompt, max_tokens=16))
        assert got["tokens"] == reference(prompt, 16)[0]
        assert (await system.stats("w0")).num_blocks > 0


async def test_gateway_https_and_tls_to_the_cache_service(certs: Certs) -> None:
    from tests.gateway.fake_worker import MODEL

    tls = {"tls_cert": certs.cert, "tls_key": certs.key}
    async with cache_running(ServiceConfig(port=0, **tls)) as svc:
        config = GatewayConfig(
            cache_service=svc.address,
            http_port=0,
            grpc_port=0,
            model=MODEL,
            tls_ca=certs.ca,
            **tls,
        )
        async with gateway_running(config, Tokenizer.load(MODEL)) as gw:
            # The gateway reaches the TLS cache service: Route answers (no pools yet).
            assert await gw.gateway.cache.route("", [1, 2, 3], MODEL) == []
            trusted = ssl.create_default_context(cafile=certs.ca)
            async with httpx.AsyncClient(verify=trusted) as http:
                resp = await http.get(f"https://{gw.http_address}/health")
                # The app's own answer over HTTPS: 503 with its worker list, as none is up.
                assert resp.status_code == 503 and resp.json()["workers"] == []
            untrusted = ssl.create_default_context(cafile=certs.other_ca)
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient(verify=untrusted) as http:
                    await http.get(f"https://{gw.http_address}/health")
            async with channel(gw.grpc_address, certs.ca) as ch:
                await _check_health(ch)
