"""Structured output: validity over the schema suite, its cost in tokens/s, grammar compile time.

One cache service and one worker process (the real ones), driven over gRPC:

- **validity**: ``--completions`` constrained completions (default 1,000), round-robin over the
  20 schemas of ``bench/structured_schemas.py``, half greedy and half sampled (temperature 1,
  seeded), ``--concurrency`` at once; each output parsed and checked with ``jsonschema``.
  Invalid means: not JSON, not valid against its schema, or cut by max_tokens.
- **cost**: tokens/s at ``--batch`` concurrent requests, constrained against unconstrained, on
  the same prompts, each request generating exactly ``--tokens`` tokens (the constrained ones
  follow a schema whose document is longer than that: an array of the suite's objects, so
  every step masks a real JSON state; the unconstrained ones ignore eos). Turns alternate
  (ABAB) so machine noise hits both alike.
- **compile**: each suite schema compiled with the worker's tokenizer, uncached (median, max),
  in this process, as the worker compiles it (``worker.model.grammar.Grammars``).

    python bench/bench_structured.py                  # the default model (SmolLM2-135M, 4-bit)
    python bench/bench_structured.py --model tiny     # the random tiny model
    python bench/bench_structured.py --quick          # 200 completions, 2 turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_generate import start  # noqa: E402

from bench.structured_schemas import SCHEMAS, check  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

QUESTION = "Reply with one JSON document that matches the schema: "


def model_path(name: str) -> str:
    if name == "default":
        from kvserve_model.default_model import ensure_default_model

        return str(ensure_default_model())
    if name == "tiny":
        from kvserve_model.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return name


# Shapes of real families, for a random model sized like one (``random_like(like=...)``).
LIKE = {
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-70b": dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def random_like(
    model: str, directory: Path, layers: int = 0, hidden: int = 0, *, like: str = "", bits: int = 0
) -> str:
    """A model with ``model``'s tokenizer and architecture (``like``: a shape of ``LIKE``;
    ``layers``/``hidden`` override its size) and random fp16 weights, quantized to ``bits``
    (group size 64, as mlx-lm's 4-bit models) where given: whose output is valid only where
    the constraint holds, on a real vocabulary. Made where it runs (the GPU machine carries
    no model wheel); a quantized one layer by layer, so a 70B-shaped model never holds its
    fp16 weights at once."""
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    config = json.loads((Path(model) / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update(LIKE[like] if like else {})
    if layers:
        config["num_hidden_layers"] = layers
    if hidden:
        heads = hidden // 64
        config.update(hidden_size=hidden, intermediate_size=4 * hidden, head_dim=64,
                      num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4))  # fmt: skip
    config["torch_dtype"] = "float16"
    directory.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    m = model_class(args_class.from_dict(config))
    m.set_dtype(mx.float16)
    n = sum(v.size for _, v in nn.utils.tree_flatten(m.parameters()))
    if bits:
        nn.quantize(m, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
        for layer in m.layers:
            mx.eval(layer.parameters())
    weights = dict(nn.utils.tree_flatten(m.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config))
    for f in Path(model).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                         "merges.txt"):  # fmt: skip
            shutil.copy(f, directory / f.name)
    print(f"# random weights: {config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, {n / 1e6:.0f}M parameters, "
          f"{f'{bits}-bit' if bits else 'fp16'}")  # fmt: skip
    return str(directory)


def prompt_ids(model: str, texts: list[str]) -> list[list[int]]:
    from kvserve_model.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(model))
    out = []
    for t in texts:
        msgs = [{"role": "user", "content": t}]
        if tok.has_chat_template:
            out.append(tok.encode(tok.render_chat(msgs, add_generation_prompt=True),
                                  add_special_tokens=False))  # fmt: skip
        else:
            out.append(tok.encode(t))
    return out


async def generate(stub, prompt: list[int], **sampling) -> tuple[str, int, int, float]:
    """(text, tokens, finish reason, seconds)."""
    start = time.perf_counter()
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling)
    )
    text, n, finish = "", 0, 0
    async for msg in stub.Generate(req):
        text += msg.text
        n += len(msg.token_ids)
        finish = msg.finish_reason or finish
    return text, n, finish, time.perf_counter() - start


async def validity(stub, model: str, completions: int, concurrency: int, max_tokens: int):
    texts = [QUESTION + json.dumps(s.schema) for s in SCHEMAS]
    prompts = prompt_ids(model, texts)
    sem = asyncio.Semaphore(concurrency)
    results: list[tuple[str, bool, bool, int]] = []

    async def one(k: int) -> None:
        i = k % len(SCHEMAS)
        sampling: dict = {"max_tokens": max_tokens,
                          "structured_output": pb.StructuredOutput(
                              json_schema=json.dumps(SCHEMAS[i].schema))}  # fmt: skip
        greedy = (k // len(SCHEMAS)) % 2 == 0
        if not greedy:
            sampling |= {"temperature": 1.0, "seed": k}
        async with sem:
            text, n, finish, _ = await generate(stub, prompts[i], **sampling)
        ok = finish == pb.FINISH_REASON_STOP and check(SCHEMAS[i].schema, text)
        results.append((SCHEMAS[i].name, greedy, ok, n))
        if not ok:
            print(f"# INVALID ({SCHEMAS[i].name}, {'greedy' if greedy else 'sampled'}, "
                  f"finish {finish}): {text[:200]!r}")  # fmt: skip

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(completions)))
    wall = time.perf_counter() - t0
    invalid = sum(not r[2] for r in results)
    tokens = sum(r[3] for r in results)
    print(f"| {model_label(model)} | {completions} | {invalid} | "
          f"{sum(not r[2] for r in results if r[1])} / {sum(not r[2] for r in results if not r[1])}"
          f" | {tokens / completions:.1f} | {wall:.1f} |")  # fmt: skip
    return invalid


def long_schema(only: str = "") -> dict:
    """An array of the suite's objects (``only``: of that schema's): a document longer than
    any ``--tokens``."""
    defs: dict = {}
    items = []
    for s in SCHEMAS:
        if only and s.name != only:
            continue  # their $defs move to the root, where their "#/$defs/..." point
        schema = dict(s.schema)
        defs |= schema.pop("$defs", {})
        items.append(schema)
    return {"type": "array", "minItems": 200, "maxItems": 200, "$defs": defs,
            "items": {"anyOf": items}}  # fmt: skip


async def cost(
    stub, model: str, batch: int, tokens: int, turns: int, only: str = "", modes_run: str = ""
) -> dict[str, float]:
    prompts = prompt_ids(model, [f"{QUESTION}{i}" for i in range(batch)])
    so = pb.StructuredOutput(json_schema=json.dumps(long_schema(only)))
    modes = {
        "unconstrained": {"ignore_eos": True},
        "constrained": {"structured_output": so},
    }
    await asyncio.gather(*(generate(stub, p, max_tokens=4, **modes["constrained"])
                           for p in prompts[:2]))  # compile once, before timing  # fmt: skip
    if modes_run:  # one mode alone, for a profiler (no ratio)
        modes = {modes_run: modes[modes_run]}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(turns):
        for mode, sampling in modes.items():
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *(generate(stub, p, max_tokens=tokens, **sampling) for p in prompts)
            )
            wall = time.perf_counter() - t0
            assert all(o[1] == tokens for o in outs), [o[1] for o in outs]
            rates[mode].append(batch * tokens / wall)
    out = {m: statistics.median(r) for m, r in rates.items()}
    if modes_run:
        return out
    # Each turn's constrained rate over the unconstrained one just before it: a shared host's
    # speed drifts between turns more than the constraint costs.
    pairs = sorted(c / u for u, c in zip(rates["unconstrained"], rates["constrained"], strict=True))
    out["paired"] = statistics.median(pairs)
    if len(pairs) >= 4:
        q = statistics.quantiles(pairs, n=4)
        print(f"# paired ratios of {len(pairs)} turns: median {out['paired']:.3f}, "
              f"quartiles {q[0]:.3f}-{q[2]:.3f}, range {pairs[0]:.3f}-{pairs[-1]:.3f}")  # fmt: skip
    return out


def compile_times(model: str) -> list[float]:
    from kvserve_model.structured_output import StructuredOutput
    from kvserve_model.tokenizer import load_tokenizer
    from worker.model.grammar import Grammars

    config = json.loads((Path(model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    tok = load_tokenizer(Path(model))
    grammars = Grammars(tok.hf, vocab, [tok.hf.eos_token_id])
    grammars.tokenizer()  # built once a worker: not a per-schema cost
    out = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        grammars.matcher(StructuredOutput.json_schema(s.schema))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def model_label(model: str) -> str:
    return Path(model).name


async def run(address: str, a: argparse.Namespace, model: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        if a.completions:
            print("| model | completions | invalid | invalid greedy / sampled | tokens each "
                  "| wall s |\n|---|---|---|---|---|---|")  # fmt: skip
            await validity(stub, model, a.completions, a.concurrency, a.max_tokens)
        rates = await cost(stub, model, a.batch, a.tokens, a.turns, a.cost_schema, a.only)
    what = f"array of {a.cost_schema}" if a.cost_schema else "array of anyOf(suite)"
    print(f"\n| batch {a.batch}, {a.tokens} tokens each, {what} | tokens/s | ratio |")
    print("|---|---|---|")
    paired = rates.pop("paired", None)
    base = rates.get("unconstrained")
    for m, r in rates.items():
        print(f"| {m} | {r:.1f} | {f'{r / base:.3f}' if base else ''} |")
    if paired is not None:
        print(f"| constrained / unconstrained, median of the turns' pairs | | {paired:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="default, tiny, or a model directory")
    p.add_argument("--completions", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--kv-memory-mb", type=int, default=1024)
    p.add_argument(
        "--cost-schema",
        default="",
        help="the cost run's documents: an array of this suite schema's objects "
        "(default: of any suite schema's, anyOf)",
    )
    p.add_argument(
        "--random",
        action="store_true",
        help="random fp16 weights with the model's tokenizer and shape",
    )
    p.add_argument("--layers", type=int, default=0, help="with --random: layers")
    p.add_argument("--hidden", type=int, default=0, help="with --random: hidden size")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--only",
        choices=["constrained", "unconstrained"],
        default="",
        help="run one mode's turns alone (to profile it: py-spy record --subprocesses)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        help="more flags for the worker, one string (e.g. '--decode-lookahead off')",
    )
    a = p.parse_args()
    if a.quick:
        a.completions, a.turns = 200, 2
    model = model_path(a.model)
    if a.random:
        import tempfile

        tmp = tempfile.mkdtemp(prefix="kvserve-random-")
        model = random_like(model, Path(tmp) / f"random-{Path(model).name}", a.layers, a.hidden)
    times = compile_times(model)
    print(f"# grammar compile (uncached, {len(times)} suite schemas, {model_label(model)}): "
          f"median {statistics.median(times):.1f} ms, max {max(times):.1f} ms\n")  # fmt: skip
    kv, kv_addr = start(
        [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", "bench"],
        "KVCACHE_READY",
    )
    worker, address = start(
        [sys.executable, "-m", "worker", "--cache-service", kv_addr, "--port", "0",
         "--worker-id", "bench", "--model", model, "--kv-memory-mb", str(a.kv_memory_mb),
         "--max-batch-size", str(max(a.batch, a.concurrency)), *shlex.split(a.worker_args)],
        "WORKER_READY",
    )  # fmt: skip
    try:
        asyncio.run(run(address, a, model))
    finally:
        for proc in (worker, kv):
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
