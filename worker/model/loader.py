"""Load a model's weights with mlx-lm, in the dtype it computes in here, and fingerprint it.

The name resolves to a directory through ``kvserve_model.resolve`` (the default model, the tiny
test model, a GGUF file converted once, a model directory, or a Hugging Face id, downloaded
where a network or a local copy exists), as the gateway resolves it for its tokenizer; this
module is the part that needs MLX.

The compute dtype (:func:`compute_dtype`) is what the activations, and so the KV pool, are in:
float32 on a CPU (MLX's CPU backend runs half precision without BLAS, about 25x slower), the
checkpoint's ``torch_dtype`` where it is half precision on a GPU. Every floating parameter is
cast to it, norms included: a GGUF ships its norms as F32 beside fp16 scales, and one F32
weight would lift every activation after it, and the pool, to float32 (seen on an H100: a
38.5 GB float32 pool for a 4-bit model).

Quantized weights on a CPU: MLX's CPU quantized matmul has no BLAS underneath. The default
model (4-bit, 135M) measured prefill 256 tokens in 31 s and decode 145 ms a token quantized,
against 1.0 s and 48 ms dequantized to float32 on the fast BLAS (2-core EPYC, bench/
bench_startup.py's model), so a CPU worker dequantizes where the float32 weights fit
(:func:`should_dequantize`): 4-8x the weights' memory for a 10-30x faster prefill. A GPU keeps
them quantized (its quantized kernels are the fast path). ``--dequantize never`` keeps them.

A model converted from GGUF is checked once by the first worker that loads it
(``kvserve_model.gguf_convert.pending_check``): one greedy answer through mlx-lm's own dense
path must be finite and, for the default model, name the expected word; a converter bug shows
as a refusal at the first start, not as fluent nonsense.

The fingerprint travels with the worker's pool registration: the cache service must never match
a prefix computed by one model against blocks of another, and two workers with the same
fingerprint may share routing. It hashes the config, the tokenizer (the index is keyed by token
ids) and every byte of the weights, each file's digest kept in a per-user cache by its path,
size, times and inode, so only a first start (or a changed file) reads them all
(``kvserve_model.fingerprint``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvserve_model.context import context_length
from kvserve_model.errors import ModelLoadError
from kvserve_model.fingerprint import model_fingerprint
from kvserve_model.gguf_convert import mark_checked, pending_check
from kvserve_model.resolve import resolve_model
from worker.model import mlx_lm_light

log = logging.getLogger(__name__)

# "auto" dequantizes on a CPU when the float32 weights take at most this share of the memory.
DEQUANTIZE_MEMORY_SHARE = 0.25
CHECK_TOKENS = 24  # of the converted model's greedy answer
HALF = {"float16": mx.float16, "bfloat16": mx.bfloat16}
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to serve: mlx-lm module, tokenizer wrapper, where it came from.

    The tokenizer loads on a thread of its own (``transformers``' import is most of a cold
    start on a host with PyTorch: ``worker.model.mlx_lm_light``); :attr:`tokenizer` waits for
    it, and raises :class:`ModelLoadError` where it failed."""

    model: nn.Module
    tokenizer_future: Future[Any]  # of mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    fingerprint: str
    config: dict[str, Any]

    @property
    def tokenizer(self) -> Any:
        try:
            return self.tokenizer_future.result()
        except Exception as e:
            raise ModelLoadError(f"the tokenizer of {self.path} did not load: {e}") from e


def load_model(
    name_or_path: str | None = None,
    *,
    dequantize: str = "auto",
    shard: Callable[[nn.Module], None] | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Resolve and load a model as ``mlx_lm.load`` does (``mlx_lm.utils.load_model``, then its
    ``load_tokenizer``), dequantized where :func:`should_dequantize` says, its floating
    parameters in :func:`compute_dtype`; check it once if it was converted from GGUF (see the
    module docstring). The tokenizer loads on its own thread meanwhile (:class:`LoadedModel`).

    ``shard``: a worker group's (``worker.model.group.shard_model`` over this rank's group). The
    weights are then loaded lazily and sharded before anything is evaluated, so a rank holds
    only its share (a model larger than one device loads), and the GGUF check waits for a load
    that is not sharded (its generation would all-reduce on one rank only). ``tokenizer=False``
    (a group's follower, which only runs forwards): none is loaded."""
    mlx_lm_light.register_package()
    t0 = time.perf_counter()
    path = resolve_model(name_or_path, log=log.info)
    t1 = time.perf_counter()
    try:
        utils = mlx_lm_light.utils()
        config = cast(dict[str, Any], utils.load_config(path))
    except Exception as e:
        raise ModelLoadError(f"mlx_lm could not read {str(path)!r}: {e}") from e
    tokens = _load_tokenizer_beside(utils, path, config) if tokenizer else _none_loaded(path)
    model, config = build_model(path, dequantize=dequantize, shard=shard)
    loaded = LoadedModel(model, tokens, path, model_fingerprint(path), config)
    if shard is None and (check := pending_check(path)) is not None:
        check_converted(model, loaded.tokenizer, path, check)
    if not tokenizer:
        state = "not needed"
    else:
        state = "loaded" if tokens.done() else "loading on its own thread"
    log.info(
        "model loaded in %.2f s (resolve %.2f s, weights %.2f s; the tokenizer %s)",
        time.perf_counter() - t0,
        t1 - t0,
        time.perf_counter() - t1,
        state,
    )
    return loaded


def build_model(
    path: Path, *, dequantize: str = "auto", shard: Callable[[nn.Module], None] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """The weights of model directory ``path`` as :func:`load_model` holds them, and the
    config: ``mlx_lm.utils.load_model`` (without transformers, ``worker.model.mlx_lm_light``),
    its floating parameters in :func:`compute_dtype`, dequantized where :func:`should_dequantize`
    says, sharded by ``shard``, evaluated. The kernel-precompile children build theirs with it
    too (``worker.precompile``)."""
    try:
        loaded = mlx_lm_light.utils().load_model(path, lazy=shard is not None)
        model, config = cast(tuple[nn.Module, dict[str, Any]], loaded)
    except Exception as e:
        raise ModelLoadError(f"mlx_lm.load({str(path)!r}) failed: {e}") from e
    cpu = mx.default_device() == mx.cpu
    dtype = compute_dtype(config, cpu)
    if dtype is not None:  # scales and biases too: a dequantized weight is computed in it
        model.set_dtype(dtype)
    if should_dequantize(model, dequantize, cpu):
        model = mlx_lm_light.utils().dequantize_model(model)
        log.info("dequantized the weights to %s: the CPU runs them on BLAS", dtype)
    if shard is not None:
        shard(model)
    mx.eval(model_arrays(model))
    return model, config


def model_arrays(model: nn.Module) -> list[mx.array]:
    """Every array ``model`` holds: its parameters, and the arrays its modules keep outside
    them. RoPE variants build their frequencies in ``__init__`` into private attributes
    (``Llama3RoPE._freqs``, YaRN's, Phi-3's longrope), not parameters, so evaluating only
    ``parameters()`` left them as graphs on the loading thread's stream; the first forward, on
    the model thread, failed with "There is no Stream(cpu, 0) in current thread": Llama 3.x,
    YaRN and longrope models, gemma4 and deepseek_v2 could not start. Evaluated here, they are
    plain arrays any thread reads."""
    out: list[mx.array] = []
    seen: set[int] = set()
    todo: list[Any] = [model]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, nn.Module):
            todo.extend(x.values())  # children and parameters
            todo.extend(vars(x).values())  # what it keeps outside them (private attributes)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return out


def _none_loaded(path: Path) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(ModelLoadError(f"no tokenizer was loaded for {path} (tokenizer=False)"))
    return future


def _load_tokenizer_beside(utils: Any, path: Path, config: Mapping[str, Any]) -> Future[Any]:
    """``mlx_lm.utils.load_tokenizer`` as ``mlx_lm.load`` calls it, on a thread of its own."""
    future: Future[Any] = Future()
    eos = config.get("eos_token_id")

    def load() -> None:
        if not future.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            tokenizer = utils.load_tokenizer(path, None, eos_token_ids=eos)
            # transformers warns past model_max_length; the model's own context is the limit.
            tokenizer._tokenizer.model_max_length = context_length(config)
        except BaseException as e:  # whatever transformers raises: the waiter reports it
            future.set_exception(e)
        else:
            log.info("tokenizer loaded in %.2f s beside the weights", time.perf_counter() - t0)
            future.set_result(tokenizer)

    threading.Thread(target=load, name="tokenizer-load", daemon=True).start()
    return future


def compute_dtype(config: Mapping[str, Any], cpu: bool) -> mx.Dtype | None:
    """The dtype the model's floating parameters are cast to: float32 on a CPU, the config's
    half-precision ``torch_dtype`` on a GPU, else None (as loaded)."""
    if cpu:
        return mx.float32
    return HALF.get(str(config.get("torch_dtype", "")))


def should_dequantize(model: nn.Module, policy: str, cpu: bool) -> bool:
    """Whether to dequantize ``model``: ``always``, ``never``, or (``auto``) on a CPU when it has
    quantized layers and its float32 weights fit :data:`DEQUANTIZE_MEMORY_SHARE` of memory."""
    bits = {name: m.bits for name, m in model.named_modules() if isinstance(m, QUANTIZED)}
    if not bits or policy == "never":
        return False
    if policy == "always":
        return True
    total = _memory_bytes()
    return cpu and (
        total is None or 4 * float32_elements(model, bits) <= DEQUANTIZE_MEMORY_SHARE * total
    )


def float32_elements(model: nn.Module, bits: Mapping[str, int]) -> int:
    """The parameter count of ``model`` dequantized: a quantized weight of ``b`` bits packs
    32 / b values in each uint32; its scales and biases go."""
    n = 0
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for name, value in params:
        module, _, leaf = name.rpartition(".")
        if module not in bits:
            n += value.size
        elif leaf == "weight":
            n += value.size * 32 // bits[module]
    return n


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_converted(model: nn.Module, tokenizer: Any, path: Path, check: Mapping[str, Any]) -> None:
    """The one check of a model converted from GGUF: its greedy answer to ``check["question"]``
    through mlx-lm's dense path is finite and contains ``check["expect"]`` where one is given.
    Raises ModelLoadError; on success records it in the directory, so it runs once."""
    from mlx_lm.models.cache import make_prompt_cache

    question = str(check.get("question", ""))
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": question}]
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt = tokenizer.encode(question)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    answer: list[int] = []
    for _ in range(CHECK_TOKENS):
        if not bool(mx.isfinite(logits).all()):
            raise ModelLoadError(f"{path}: the converted model's logits are not finite")
        token = int(mx.argmax(logits, axis=-1)[0])
        if token in tokenizer.eos_token_ids:
            break
        answer.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    text = tokenizer.decode(answer)
    expect = check.get("expect")
    if expect and str(expect) not in text:
        raise ModelLoadError(
            f"{path}: the converted model answered {question!r} with {text!r}, "
            f"without {expect!r}: the conversion is wrong (a kvserve bug; please report it)"
        )
    mark_checked(path, text)
    log.info("converted model checked: %r -> %r (%.2f s)", question, text, time.perf_counter() - t0)
