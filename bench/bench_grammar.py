"""Grammar-engine benchmark for structured output (issue 32): llguidance, xgrammar, outlines-core.

On the default model's tokenizer (SmolLM2-135M-Instruct, 49,152 tokens) and the schema suite of
``bench/structured_schemas.py``, for each engine that imports:

- **tokenizer init**: the engine's tokenizer object from the Hugging Face tokenizer, once;
- **compile**: schema to a matcher ready for its first mask, every time from scratch (caches
  off), median and max over the suite and the repeats; **first mask** adds that mask (the
  cost a request sees before its first constrained token, where an engine builds lazily);
- **mask, batch 1**: per token of each schema's example (``json.dumps`` with ``", "`` and
  ``": "``, tokenized by the model's tokenizer): fill the bitmask, check the token is allowed,
  consume it; median, p99 and max over every step of every walk (fresh matchers every repeat,
  so lazily built states are paid for in the numbers);
- **mask, batch 32**: 32 matchers over the suite's schemas (schema ``i % 20``) stepped
  together, one batched fill per step (llguidance: ``LLExecutor`` +
  ``fill_next_token_bitmask_par``; xgrammar: ``BatchGrammarMatcher``; outlines-core has none,
  so one ``write_mask_into`` per matcher), a finished matcher reset onto its example again
  so the batch stays full; median and p99 of a batch step;
- **correctness**: each example accepted token by token, then the end-of-sequence token
  allowed (an accepting end); each invalid instance refused: some token of its tokenization,
  or the end-of-sequence token after it, is not allowed. A schema an engine will not compile
  counts against both.

Every engine emits compact JSON with ``", "`` and ``": "`` and no free whitespace
(llguidance ``whitespace_flexible: false``; xgrammar ``any_whitespace=False``; outlines-core
allows its default ``[ ]?`` around separators, which these examples satisfy).

xgrammar and outlines-core are measured from a separate directory, not the project's venv
(xgrammar requires torch and CUDA wheels, gigabytes):

    pip install --no-deps --target /tmp/gbench-site xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=/tmp/gbench-site python bench/bench_grammar.py --repeat 5 --per-schema
    python bench/bench_grammar.py --engines llguidance --repeat 3

xgrammar 0.2 imports torch at module level (``xgrammar/matcher.py``, ``testing.py``) though
its CPU paths take any DLPack array: where torch is not installed it is imported here behind a
stand-in ``torch`` module (a few attributes, removed again at once) and fills numpy bitmasks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.structured_schemas import SCHEMAS, Schema  # noqa: E402

SEPARATORS = (", ", ": ")
BATCH = 32
BATCH_STEPS = 128


def compact(instance: object) -> str:
    return json.dumps(instance, separators=SEPARATORS)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class Engine(ABC):
    """One grammar engine behind the calls the benchmark makes. A *compiled* grammar is what
    ``compile`` returns; ``matcher`` makes a fresh matcher from it (cheap), ``reset`` rewinds
    one to the start."""

    name: str
    version: str
    eos: int
    vocab_size: int

    @abstractmethod
    def load_tokenizer(self, hf: Any) -> None: ...

    @abstractmethod
    def compile(self, schema: dict[str, Any]) -> tuple[Any, Any]:
        """The compiled grammar and a first matcher on it, ready for its first mask. Raises
        (any exception) where the engine refuses the schema."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Any: ...

    @abstractmethod
    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        """The next-token mask into ``bitmask[0]``."""

    @abstractmethod
    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        """Matcher i's mask into ``bitmask[i]``, with the engine's batched fill if it has one."""

    @abstractmethod
    def consume(self, matcher: Any, token: int) -> bool: ...

    @abstractmethod
    def finish(self, matcher: Any) -> bool:
        """Given that the end-of-sequence token is allowed: end there, whether it accepts."""

    @abstractmethod
    def reset(self, matcher: Any) -> None: ...

    def bitmask(self, batch: int) -> np.ndarray:
        return np.zeros((batch, (self.vocab_size + 31) // 32), dtype=np.int32)


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.np = llguidance.numpy
        self.version = llguidance.__version__
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def load_tokenizer(self, hf: Any) -> None:
        self.tokenizer = self.llg.hf.from_tokenizer(hf)
        self.eos = self.tokenizer.eos_token
        self.vocab_size = self.tokenizer.vocab_size

    def compile(self, schema: dict[str, Any]) -> tuple[Any, Any]:
        # The matcher is the compiled grammar: more matchers are copies of it, rewound.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            overrides={
                "whitespace_flexible": False,
                "item_separator": SEPARATORS[0],
                "key_separator": SEPARATORS[1],
            },
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher, matcher

    def matcher(self, compiled: Any) -> Any:
        copy = compiled.deep_copy()
        copy.reset()
        return copy

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, 0)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.np.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def finish(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting() and matcher.consume_token(self.eos))

    def reset(self, matcher: Any) -> None:
        matcher.reset()


def import_xgrammar() -> types.ModuleType:
    """xgrammar, behind a stand-in torch where torch is not installed (module docstring).
    tvm_ffi and transformers look for a real torch: they are imported first, without it."""
    if importlib.util.find_spec("torch") is not None:
        import xgrammar

        return xgrammar
    import transformers  # noqa: F401
    import tvm_ffi  # noqa: F401

    # Module level, xgrammar only names dtypes, builds one tensor and annotates with classes.
    stub = types.ModuleType("torch")
    stub.tensor = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    stub.__getattr__ = lambda name: type(name, (), {})  # type: ignore[method-assign]
    sys.modules["torch"] = stub
    try:
        import xgrammar
    finally:
        del sys.modules["torch"]
    return xgrammar


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.xgr = import_xgrammar()
        self.version = importlib.metadata.version("xgrammar")
        self.batcher = self.xgr.BatchGrammarMatcher(max_threads=threads)

    def load_tokenizer(self, hf: Any) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf)
        self.compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        self.eos = hf.eos_token_id
        self.vocab_size = self.info.vocab_size

    def compile(self, schema: dict[str, Any]) -> tuple[Any, Any]:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )
        return compiled, self.xgr.GrammarMatcher(compiled)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def finish(self, matcher: Any) -> bool:
        return bool(matcher.accept_token(self.eos) and matcher.is_terminated())

    def reset(self, matcher: Any) -> None:
        matcher.reset()


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: how SmolLM2's vocabulary spells bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    rest = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(rest)})
    return {c: b for b, c in chars.items()}


class Outlines(Engine):
    """outlines-core: the schema becomes one regular expression, compiled into a token-level
    DFA index over the whole vocabulary (the ``outlines`` library's path)."""

    name = "outlines-core"

    def __init__(self, threads: int) -> None:
        # No batched fill and a single-threaded compile: ``threads`` has nothing to set.
        import outlines_core

        self.oc = outlines_core
        self.version = importlib.metadata.version("outlines-core")

    def load_tokenizer(self, hf: Any) -> None:
        # The vocabulary as token bytes; added tokens (chat markers) are not text.
        decoder = byte_decoder()
        special = set(hf.all_special_ids) | set(hf.added_tokens_decoder)
        by_bytes: dict[bytes, list[int]] = {}
        for piece, token in hf.get_vocab().items():
            if token not in special:
                by_bytes.setdefault(bytes(decoder[c] for c in piece), []).append(token)
        self.eos = hf.eos_token_id
        self.vocab = self.oc.Vocabulary(self.eos, by_bytes)
        self.vocab_size = len(hf)

    def compile(self, schema: dict[str, Any]) -> tuple[Any, Any]:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        index = self.oc.Index(regex, self.vocab)
        return index, self.oc.Guide(index)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        row = bitmask[0]
        matcher.write_mask_into(row.ctypes.data, row.size, 4)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def finish(self, matcher: Any) -> bool:
        # A finished guide has no transition on EOS (advance raises): it is simply final.
        return bool(matcher.is_finished())

    def reset(self, matcher: Any) -> None:
        matcher.reset()


ENGINES: dict[str, Callable[[int], Engine]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "outlines": Outlines,
}


@dataclass
class Result:
    engine: str
    init_s: float = 0.0
    # Per schema: every compile's seconds, every batch-1 fill's seconds.
    compile_by: dict[str, list[float]] = field(default_factory=dict)
    mask1_by: dict[str, list[float]] = field(default_factory=dict)
    first_mask_s: list[float] = field(default_factory=list)
    mask32_s: list[float] = field(default_factory=list)
    refused_schemas: dict[str, str] = field(default_factory=dict)  # name: the engine's error
    refused_examples: set[str] = field(default_factory=set)
    invalid_refused: int = 0
    accepted_invalid: list[tuple[str, str]] = field(default_factory=list)  # (schema, text)

    @property
    def compile_s(self) -> list[float]:
        return [t for times in self.compile_by.values() for t in times]

    @property
    def mask1_s(self) -> list[float]:
        return [t for times in self.mask1_by.values() for t in times]

    @property
    def examples_accepted(self) -> int:
        return len(SCHEMAS) - len(self.refused_schemas) - len(self.refused_examples)

    def slowest(self) -> str:
        """The schemas behind the worst compile and the worst batch-1 step."""
        worst_compile = max(self.compile_by, key=lambda n: max(self.compile_by[n]))
        worst_step = max(self.mask1_by, key=lambda n: max(self.mask1_by[n]))
        return (
            f"{self.engine}: slowest compile {worst_compile} "
            f"({ms(max(self.compile_by[worst_compile]))} ms), "
            f"slowest step {worst_step} ({us(max(self.mask1_by[worst_step]))} µs)"
        )


def walk(
    engine: Engine, matcher: Any, tokens: list[int], bitmask: np.ndarray
) -> tuple[bool, list[float]]:
    """Step ``matcher`` through ``tokens`` then the end token: per step fill, check, consume.
    Returns whether every step was allowed (and the end accepting), and each fill's seconds."""
    times = []
    for token in [*tokens, engine.eos]:
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append(time.perf_counter() - start)
        if not allowed(bitmask[0], token):
            return False, times
        if token == engine.eos:
            return engine.finish(matcher), times
        if not engine.consume(matcher, token):
            return False, times
    raise AssertionError("unreachable: the end token ends the walk")


def measure_single(
    engine: Engine, tokens: dict[str, list[int]], result: Result, first: bool
) -> dict[str, Any]:
    """One pass over the suite: compile each schema from scratch, walk its example."""
    compiled = {}
    bitmask = engine.bitmask(1)
    for case in SCHEMAS:
        start = time.perf_counter()
        try:
            compiled[case.name], matcher = engine.compile(case.schema)
        except Exception as e:  # the engines' error types differ; every one is a refusal
            result.refused_schemas.setdefault(case.name, f"{type(e).__name__}: {e}"[:160])
            continue
        compile_s = time.perf_counter() - start
        ok, times = walk(engine, matcher, tokens[case.name], bitmask)
        result.compile_by.setdefault(case.name, []).append(compile_s)
        result.first_mask_s.append(compile_s + times[0])
        result.mask1_by.setdefault(case.name, []).extend(times)
        if first and not ok:
            result.refused_examples.add(case.name)
    return compiled


def measure_invalid(
    engine: Engine, compiled: dict[str, Any], encode: Callable[[str], list[int]], result: Result
) -> None:
    bitmask = engine.bitmask(1)
    for case in SCHEMAS:
        if case.name not in compiled:
            continue
        for instance in case.invalid:
            text = compact(instance)
            matcher = engine.matcher(compiled[case.name])
            accepted, _ = walk(engine, matcher, encode(text), bitmask)
            result.invalid_refused += not accepted
            if accepted:
                result.accepted_invalid.append((case.name, text))


def measure_batch(
    engine: Engine,
    cases: list[Schema],
    compiled: dict[str, Any],
    tokens: dict[str, list[int]],
    result: Result,
) -> None:
    """BATCH matchers stepped together for BATCH_STEPS batched fills (module docstring)."""
    lanes = [cases[i % len(cases)] for i in range(BATCH)]
    matchers = [engine.matcher(compiled[c.name]) for c in lanes]
    position = [0] * BATCH
    bitmask = engine.bitmask(BATCH)
    for _ in range(BATCH_STEPS):
        start = time.perf_counter()
        engine.fill_batch(matchers, bitmask)
        result.mask32_s.append(time.perf_counter() - start)
        for i, case in enumerate(lanes):
            walk_tokens = tokens[case.name]
            if position[i] == len(walk_tokens):  # at the end token: start the example again
                engine.reset(matchers[i])
                position[i] = 0
                continue
            token = walk_tokens[position[i]]
            if not (allowed(bitmask[i], token) and engine.consume(matchers[i], token)):
                raise RuntimeError(f"{engine.name}: batch walk refused {case.name}'s example")
            position[i] += 1


def run_engine(engine: Engine, hf: Any, repeat: int) -> Result:
    result = Result(f"{engine.name} {engine.version}")
    start = time.perf_counter()
    engine.load_tokenizer(hf)
    result.init_s = time.perf_counter() - start

    def encode(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False))

    # A process's first compile and walk also start thread pools and allocators: not a schema's.
    warm_up, _ = engine.compile({"type": "boolean"})
    walk(engine, engine.matcher(warm_up), encode("true"), engine.bitmask(1))

    tokens = {c.name: encode(compact(c.example)) for c in SCHEMAS}
    compiled: dict[str, Any] = {}
    for r in range(repeat):
        compiled = measure_single(engine, tokens, result, first=r == 0)
    measure_invalid(engine, compiled, encode, result)
    accepted = [c for c in SCHEMAS if c.name in compiled and c.name not in result.refused_examples]
    measure_batch(engine, accepted, compiled, tokens, result)
    return result


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


ROWS: list[tuple[str, Callable[[Result], str]]] = [
    ("tokenizer init (ms)", lambda r: ms(r.init_s)),
    ("compile, median (ms)", lambda r: ms(statistics.median(r.compile_s))),
    ("compile, max (ms)", lambda r: ms(max(r.compile_s))),
    ("compile + first mask, median (ms)", lambda r: ms(statistics.median(r.first_mask_s))),
    ("compile + first mask, max (ms)", lambda r: ms(max(r.first_mask_s))),
    ("mask batch 1, median (µs)", lambda r: us(statistics.median(r.mask1_s))),
    ("mask batch 1, p99 (µs)", lambda r: us(p99(r.mask1_s))),
    ("mask batch 1, max (µs)", lambda r: us(max(r.mask1_s))),
    ("mask batch 32, median (µs per step)", lambda r: us(statistics.median(r.mask32_s))),
    ("mask batch 32, p99 (µs per step)", lambda r: us(p99(r.mask32_s))),
    ("schemas compiled", lambda r: f"{len(SCHEMAS) - len(r.refused_schemas)}/{len(SCHEMAS)}"),
    ("examples accepted", lambda r: f"{r.examples_accepted}/{len(SCHEMAS)}"),
    ("invalid instances refused", lambda r: f"{r.invalid_refused}/{2 * len(SCHEMAS)}"),
]


def table(results: list[Result], missing: list[str]) -> str:
    """Metric x engine, markdown; an engine that did not import gets a column that says so."""
    names = [r.engine for r in results] + missing
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, cell in ROWS:
        cells = [cell(r) for r in results] + ["not importable"] * len(missing)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_schema_table(results: list[Result]) -> str:
    """Schema x engine: median compile (ms) / worst batch-1 step (µs), or what went wrong."""
    lines = [
        "| schema | " + " | ".join(r.engine for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for case in SCHEMAS:
        cells = []
        for r in results:
            if case.name in r.refused_schemas:
                cells.append("refused")
                continue
            cell = f"{ms(statistics.median(r.compile_by[case.name]))} / "
            cell += us(max(r.mask1_by[case.name]))
            bad = sum(name == case.name for name, _ in r.accepted_invalid)
            cells.append(cell + (f" ({bad} invalid accepted)" if bad else ""))
        lines.append(f"| {case.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", default="llguidance,xgrammar,outlines", help=", ".join(ENGINES))
    p.add_argument("--repeat", type=int, default=3, help="passes over the suite (compile + walk)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="batched fills, compiles"
    )
    p.add_argument("--per-schema", action="store_true", help="also a schema x engine table")
    args = p.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {', '.join(sorted(unknown))}; known: {', '.join(ENGINES)}")

    from kvserve_model.default_model import ensure_default_model
    from kvserve_model.tokenizer import load_tokenizer

    hf = load_tokenizer(ensure_default_model()).hf
    results: list[Result] = []
    missing: dict[str, str] = {}
    for name in args.engines.split(","):
        try:
            engine = ENGINES[name](args.threads)
        except ImportError as e:
            missing[name] = f"{type(e).__name__}: {e}"
            continue
        results.append(run_engine(engine, hf, args.repeat))

    print(f"# {len(SCHEMAS)} schemas, {args.repeat} repeats, {args.threads} threads, ", end="")
    print(f"vocabulary {len(hf)}\n")
    print(table(results, list(missing)))
    if args.per_schema and results:
        print("\nper schema: median compile (ms) / slowest batch-1 step (µs)\n")
        print(per_schema_table(results))
    print()
    for r in results:
        print(r.slowest())
        for schema, error in r.refused_schemas.items():
            print(f"{r.engine} refused {schema}: {error}")
        for example in sorted(r.refused_examples):
            print(f"{r.engine} refused the example of {example}")
        for schema, text in r.accepted_invalid:
            print(f"{r.engine} accepted invalid {schema}: {text}")
    for name, error in missing.items():
        print(f"{name} not importable: {error}")


if __name__ == "__main__":
    main()
