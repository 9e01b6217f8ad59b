"""Worker benchmark: a burst sharing a long prompt, with and without prefix caching.

8 concurrent Generate requests share a 1,500-token prompt, each adds 32 tokens of its own
and generates 32 (ignore_eos). The same burst runs against a worker with prefix caching
and one started with --no-prefix-caching, in one run, each with its own cache service, on a
~110M-parameter random Llama in fp32 (made locally). Reported: TTFT p50/p95, output
tokens/s over the burst, prefilled tokens (worker stats) and peak KV blocks in use.

    python bench/bench_generate.py            # about 2 minutes here
    python bench/bench_generate.py --quick    # a 4-layer model, fewer tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_models import save_model  # noqa: E402

from kvserve_model.blas import fast_blas_env  # noqa: E402
from kvserve_model.tiny_model import ensure_tiny_model  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

TOKEN = "bench"


def make_model(directory: Path, layers: int, hidden: int) -> Path:
    """A random Llama with the default model's byte-level tokenizer."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    base = ensure_tiny_model()
    config = json.loads((base / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=4096,
    )
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    params = save_model(directory, model, config, base)
    print(f"# model: {layers} layers, hidden {hidden}, {params / 1e6:.0f}M parameters, fp32")
    return directory


def start(cmd: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=fast_blas_env())
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line.split()[1]
    raise RuntimeError(f"{cmd[2]} exited before it was ready")


async def burst(address: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)

        async def one(p: list[int]) -> tuple[float, int, int]:
            start = time.perf_counter()
            first, n, cached = 0.0, 0, 0
            req = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=p),
                sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            async for msg in stub.Generate(req):
                if msg.token_ids and not first:
                    first = time.perf_counter() - start
                n += len(msg.token_ids)
                if msg.finish_reason:
                    cached = msg.usage.cached_tokens
            return first, n, cached

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        info = await stub.GetInfo(pb.GetInfoRequest())
    ttft = np.array([r[0] for r in results]) * 1000
    return {
        "TTFT p50 ms": float(np.percentile(ttft, 50)),
        "TTFT p95 ms": float(np.percentile(ttft, 95)),
        "wall s": wall,
        "output tok/s": sum(r[1] for r in results) / wall,
        "cached tokens": sum(r[2] for r in results),
        "prefilled tokens": info.prefilled_tokens,
    }


def run_one(model_dir: Path, prompts, max_tokens: int, caching: bool) -> dict[str, float]:
    kv, kv_addr = start(
        [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", TOKEN],
        "KVCACHE_READY",
    )
    flags = [] if caching else ["--no-prefix-caching"]
    worker, address = start(
        [
            sys.executable, "-m", "worker", "--cache-service", kv_addr, "--port", "0",
            "--worker-id", "bench", "--model", str(model_dir), "--max-step-tokens", "512",
            "--kv-memory-mb", "1024",
            *flags,
        ],
        "WORKER_READY",
    )  # fmt: skip
    try:
        row = asyncio.run(burst(address, prompts, max_tokens))
        with grpc.insecure_channel(kv_addr) as channel:
            admin = kpb_grpc.KVCacheAdminStub(channel)
            md = [("authorization", f"Bearer {TOKEN}")]
            stats = admin.GetStats(kpb.StatsRequest(pool_id="bench"), metadata=md).pools[0]
            assert admin.CheckIntegrity(kpb.CheckIntegrityRequest(), metadata=md).ok
        row["peak KV blocks"] = stats.peak_used_blocks
        return row
    finally:
        for proc in (worker, kv):
            proc.terminate()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    layers, hidden, shared, own, out, n = (
        (4, 256, 500, 32, 16, 8) if a.quick else (12, 768, 1500, 32, 32, 8)
    )
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, shared).tolist()
    prompts = [base + rng.integers(0, 256, own).tolist() for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", layers, hidden)
        print(f"# {n} concurrent requests: {shared} shared + {own} own tokens, {out} generated\n")
        rows = {
            "prefix caching": run_one(model_dir, prompts, out, caching=True),
            "no prefix caching": run_one(model_dir, prompts, out, caching=False),
        }
    cols = list(rows["prefix caching"])
    print("| worker | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    on, off = rows["prefix caching"], rows["no prefix caching"]
    print(
        f"\nwith caching: TTFT p50 {off['TTFT p50 ms'] / on['TTFT p50 ms']:.1f}x lower, "
        f"{on['output tok/s'] / off['output tok/s']:.1f}x tokens/s, "
        f"{off['peak KV blocks'] / on['peak KV blocks']:.1f}x fewer peak KV blocks"
    )


if __name__ == "__main__":
    main()
