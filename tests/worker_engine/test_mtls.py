"""Mutual TLS (``--tls-client-ca``): the cache service, a worker's port and the gateway's ports
refuse a client without a certificate their client CA signed, and every process presents its
own ``--tls-cert`` when it dials, so the whole chain (gateway -> TLS worker -> TLS cache
service) authenticates both ways. Certificates made with the openssl CLI."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.server import running as gateway_running
from kvcache_service import admin_cli
from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as cache_running
from kvserve_launch import healthcheck
from kvserve_launch.tls import Dialer, channel
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.tls_certs import Certs, make_certs, needs_openssl
from tests.worker_engine.conftest import TOKEN, generate, request, started_system
from worker.config import WorkerConfig
from worker.model.loader import LoadedModel

pytestmark = needs_openssl


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("mtls"))


def refused_clients(certs: Certs, address: str) -> dict[str, grpc.aio.Channel]:
    """Channels a mutual-TLS port must refuse, by what is wrong with each."""
    return {
        "plaintext": grpc.aio.insecure_channel(address),
        "no client certificate": channel(address, certs.ca),
        "another CA's certificate": channel(
            address, certs.ca, cert=certs.stranger_cert, key=certs.stranger_key
        ),
    }


async def health(ch: grpc.aio.Channel) -> int:
    resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status


async def assert_refused(certs: Certs, address: str, call: Callable = health) -> None:
    for why, ch in refused_clients(certs, address).items():
        async with ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, why


def mtls(certs: Certs) -> dict[str, str]:
    """A process's settings: its pair serves and identifies it, the CA verifies both ways."""
    return {"tls_cert": certs.cert, "tls_key": certs.key, "tls_client_ca": certs.ca}


def client(certs: Certs) -> Dialer:
    return Dialer.from_files(certs.ca, cert=certs.client_cert, key=certs.client_key)


async def test_cache_service_requires_a_client_certificate_its_ca_signed(certs: Certs) -> None:
    async with cache_running(ServiceConfig(port=0, admin_token=TOKEN, **mtls(certs))) as svc:
        await assert_refused(certs, svc.address)
        async with client(certs).aio(svc.address) as ch:
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
        # The admin CLI and the container health check (synchronous: run beside the loop).
        base = ["--address", svc.address, "--token", TOKEN, "--tls-ca", certs.ca]
        identity = ["--tls-cert", certs.client_cert, "--tls-key", certs.client_key]
        assert await asyncio.to_thread(admin_cli.main, [*base, *identity, "check"]) == 0
        assert await asyncio.to_thread(admin_cli.main, [*base, "check"]) == 1
        probe = ["grpc", svc.address, "--tls-ca", certs.ca, "--timeout-s", "5"]
        assert await asyncio.to_thread(healthcheck.main, [*probe, *identity]) == 0
        assert await asyncio.to_thread(healthcheck.main, probe) == 1


async def test_a_worker_registers_through_mtls_and_its_port_requires_certificates(
    certs: Certs, model: LoadedModel, reference
) -> None:
    """The worker presents its --tls-cert to the cache service (else it never registers) and
    its own port refuses callers without a certificate the client CA signed."""
    async with started_system(model, dialer=client(certs), **mtls(certs)) as system:
        async with asyncio.timeout(30):  # a worker refused by the service retries forever
            stub = await system.add_worker(tls_ca=certs.ca, **mtls(certs))
        prompt = list(range(3, 40))
        got = await generate(stub, request(prompt, max_tokens=16))
        assert got["tokens"] == reference(prompt, 16)[0]
        assert (await system.stats("w0")).num_blocks > 0
        await assert_refused(certs, system.workers[0].address)
        await assert_refused(
            certs,
            system.workers[0].address,
            lambda ch: pb_grpc.WorkerStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5),
        )
        await system.wait_idle()


async def test_gateway_to_a_tls_worker_to_a_tls_cache_service(
    certs: Certs, model: LoadedModel
) -> None:
    """An HTTPS completion through the gateway, a worker whose own port serves mutual TLS, and
    a mutual-TLS cache service: every hop verified both ways. The gateway's ports require
    client certificates too (its --tls-client-ca)."""
    async with started_system(model, dialer=client(certs), **mtls(certs)) as system:
        async with asyncio.timeout(30):
            await system.add_worker(tls_ca=certs.ca, **mtls(certs))
        config = GatewayConfig(
            cache_service=system.cache_address,
            http_port=0,
            grpc_port=0,
            model=TINY_MODEL_NAME,
            tls_ca=certs.ca,
            **mtls(certs),
        )
        async with gateway_running(config) as gw:
            assert gw.gateway.healthy_workers() == 1  # dialed the worker over mutual TLS
            trusted = ssl.create_default_context(cafile=certs.ca)
            trusted.load_cert_chain(certs.client_cert, certs.client_key)
            body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
            async with httpx.AsyncClient(verify=trusted, timeout=60) as http:
                resp = await http.post(f"https://{gw.http_address}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"]
            assert resp.json()["usage"]["completion_tokens"] == 8
            # The admin pass-through reaches the cache service over the gateway's channel.
            async with httpx.AsyncClient(verify=trusted, timeout=60) as http:
                stats = await http.get(
                    f"https://{gw.http_address}/admin/cache/stats",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            assert stats.status_code == 200 and "w0" in stats.text, stats.text
            # The container health check of an HTTPS port that requires client certificates.
            url = f"https://{gw.http_address}/health"
            probe = ["http", url, "--tls-ca", certs.ca, "--timeout-s", "5"]
            identity = ["--tls-cert", certs.client_cert, "--tls-key", certs.client_key]
            assert await asyncio.to_thread(healthcheck.main, [*probe, *identity]) == 0
            assert await asyncio.to_thread(healthcheck.main, probe) == 1
            no_cert = ssl.create_default_context(cafile=certs.ca)
            with pytest.raises(httpx.TransportError):
                async with httpx.AsyncClient(verify=no_cert) as http:
                    await http.post(f"https://{gw.http_address}/v1/completions", json=body)
            with pytest.raises(httpx.TransportError):
                async with httpx.AsyncClient() as http:  # plaintext to the HTTPS port
                    await http.post(f"http://{gw.http_address}/v1/completions", json=body)
            # The gateway's gRPC Generate, the same chain.
            async with client(certs).aio(gw.grpc_address) as ch:
                got = await generate(pb_grpc.WorkerStub(ch), request(list(range(3, 20)), 4))
                assert len(got["tokens"]) == 4
            await assert_refused(certs, gw.grpc_address)
        await system.wait_idle()


@pytest.mark.parametrize(
    "from_args", [ServiceConfig.from_args, WorkerConfig.from_args, GatewayConfig.from_args]
)
def test_client_ca_needs_a_tls_port(from_args, capsys) -> None:
    with pytest.raises(SystemExit):
        from_args(["--tls-client-ca", "ca.pem"])
    assert "--tls-client-ca" in capsys.readouterr().err
    config = from_args(["--tls-cert", "a.pem", "--tls-key", "a.key", "--tls-client-ca", "ca.pem"])
    assert config.tls_client_ca == "ca.pem"
