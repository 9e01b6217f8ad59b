"""Structured output, logit bias and penalties on a real worker (the tiny random model, whose
output is only valid when the constraint holds), batched with requests that have none."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator

import grpc
import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import System, generate, request, started_system
from worker.model.loader import LoadedModel, load_model


@pytest.fixture(params=["plain", "lookahead"])
async def system(request: pytest.FixtureRequest, model: LoadedModel) -> AsyncIterator[System]:
    """Every test twice: as is, and with the decode lookahead, whose next forward is built on
    the argmax of the adjusted, masked logits."""
    async with started_system(model) as s:
        s.lookahead = "on" if request.param == "lookahead" else "off"
        yield s


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}


CRASHED_LLGUIDANCE = (
    '{"type":"integer","minimum":-9223372036854775807,"maximum":-9223372036854775803}'
)


def prompt(seed: int, n: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def constrained(p: list[int], so: pb.StructuredOutput, **kw) -> pb.GenerateRequest:
    kw.setdefault("max_tokens", 200)
    return request(p, ignore_eos=False, structured_output=so, **kw)


def schema(s: dict) -> pb.StructuredOutput:
    return pb.StructuredOutput(json_schema=json.dumps(s))


async def test_json_schema_outputs_validate_batched_with_unconstrained_rows(
    system: System, reference
) -> None:
    stub = await system.add_worker()
    masks = system.workers[0].engine.executor.masks
    plain = [prompt(100 + i, 6) for i in range(3)]
    jobs = [generate(stub, request(p, max_tokens=12)) for p in plain]
    for i in range(6):  # greedy and sampled, with and without a seed
        sampling = {} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        jobs.append(generate(stub, constrained(prompt(i), schema(PERSON), **sampling)))
    outs = await asyncio.gather(*jobs)
    for p, out in zip(plain, outs[:3], strict=True):  # unconstrained rows: exactly their tokens
        assert out["tokens"] == reference(p, 12)[0]
    for out in outs[3:]:
        assert out["last"].finish_reason == pb.FINISH_REASON_STOP, out["text"]
        jsonschema.validate(json.loads(out["text"]), PERSON)
        # Written in the schema's property order (not sorted: "age" < "name").
        assert list(json.loads(out["text"])) == list(PERSON["properties"])
    greedy = await asyncio.gather(  # greedy only: a step the lookahead may take
        *(generate(stub, constrained(prompt(i), schema(PERSON))) for i in (0, 2, 4))
    )
    for out, want in zip(greedy, outs[3::2], strict=True):  # the same tokens as batched
        assert out["tokens"] == want["tokens"]
    if system.lookahead == "on":
        assert system.workers[0].engine.executor.lookahead_hits > 0
        assert masks.early > 0  # filled as a lookahead step's tokens came, kept by the loop
    assert masks.used > 0  # masks filled between steps, off the critical path
    await system.wait_idle()


async def test_regex_choice_and_grammars(system: System) -> None:
    stub = await system.add_worker()
    cases = [
        (pb.StructuredOutput(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"), None),
        (pb.StructuredOutput(choice=pb.Choices(values=["red", "green", 'bl"ue\n'])), None),
        (pb.StructuredOutput(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/\n'), None),
        (pb.StructuredOutput(grammar='root ::= "yes" | "no" | "n/a"'), None),
        # Any object: a random model would write one forever; a bias towards closing strings
        # and objects ends it (the constraint alone decides what is valid).
        (pb.StructuredOutput(json_object=True), {ord('"'): 6.0, ord("}"): 6.0}),
    ]
    for k, (so, bias) in enumerate(cases):
        for sampling in ({}, {"temperature": 1.0, "seed": k}):
            out = await generate(
                stub, constrained(prompt(k), so, logit_bias=bias or {}, max_tokens=300, **sampling)
            )
            text = out["text"]
            assert out["last"].finish_reason == pb.FINISH_REASON_STOP, text
            which = so.WhichOneof("kind")
            if which == "regex":
                assert re.fullmatch(so.regex, text), text
            elif which == "choice":
                assert text in so.choice.values
            elif which == "json_object":
                assert isinstance(json.loads(text), dict)
            elif "::=" in so.grammar:
                assert text in ("yes", "no", "n/a")
            else:
                assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text
    await system.wait_idle()


async def test_a_constraint_that_does_not_compile_is_invalid_argument(system: System) -> None:
    stub = await system.add_worker()
    bad = [
        (
            pb.StructuredOutput(
                json_schema='{"type": "object", "properties": {"a": {"$ref": "#/x"}}}'
            ),
            "'/x' does not exist",
        ),
        (pb.StructuredOutput(json_schema="{not json"), "JSON"),
        (pb.StructuredOutput(regex="[a-z"), "regex"),
        (pb.StructuredOutput(grammar="start: undefined_rule"), "undefined_rule"),
        (pb.StructuredOutput(choice=pb.Choices()), "choice"),
        (schema({"type": "integer", "maximum": 10**20}), "beyond ±2^53"),
        # A Lark grammar can embed a schema that crashed llguidance 1.9.1 (SIGSEGV): it is
        # compiled first in a child process, so this worker (in this test's process) lives.
        (pb.StructuredOutput(grammar=f"start: %json{CRASHED_LLGUIDANCE}\n"), "grammar"),
    ]
    for so, says in bad:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, constrained(prompt(1), so))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (info.value.details() or ""), info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the output could never end
        await generate(stub, request(prompt(1), ignore_eos=True, structured_output=schema(PERSON)))
    assert "ignore_eos" in (info.value.details() or "")
    out = await generate(stub, constrained(prompt(2), schema(PERSON)))  # the worker goes on
    jsonschema.validate(json.loads(out["text"]), PERSON)
    await system.wait_idle()


async def test_a_constraint_no_text_satisfies_is_invalid_argument(system: System) -> None:
    """llguidance compiles these without error and fails at their first mask, which then
    allows only EOS: the request ended "stop" with empty output (a 200 with content "").
    Refused before generating, every time (nothing failed is cached)."""
    stub = await system.add_worker()
    grammars = system.workers[0].engine.intake.grammars
    loops = {"$ref": "#/$defs/b", "$defs": {"b": {"$ref": "#/$defs/b"}}}
    for so in (pb.StructuredOutput(regex=r"[^\s\S]x"), schema(loops)):
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, constrained(prompt(1), so))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "admits no output" in (info.value.details() or ""), info.value.details()
    assert grammars.compiles == 0 and not grammars._compiled
    out = await generate(stub, constrained(prompt(2), schema(PERSON)))  # the worker goes on
    jsonschema.validate(json.loads(out["text"]), PERSON)
    await system.wait_idle()


async def test_a_constraint_failing_while_generating_ends_invalid_argument(
    system: System,
) -> None:
    """A regex past llguidance's lexer limits compiles, fills its first mask, and fails at its
    first token. Its request ends INVALID_ARGUMENT naming the engine's error, each time (a
    failed copy leaves the shared lexer cache spent: later copies failed in their first fill,
    where only EOS stays allowed, and ended "stop" with empty output); the failed constraint
    is dropped from the cache; requests batched with it are unaffected."""
    stub = await system.add_worker()
    grammars = system.workers[0].engine.intake.grammars
    huge = pb.StructuredOutput(regex="(b{1000}){999}")
    for round_ in range(2):
        plain, bad = await asyncio.gather(
            generate(stub, request(prompt(50), max_tokens=6)),
            generate(stub, constrained(prompt(3), huge, max_tokens=4)),
            return_exceptions=True,
        )
        assert isinstance(bad, grpc.aio.AioRpcError), bad
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.details()
        assert "structured output failed while generating" in (bad.details() or "")
        assert "too many expressions" in (bad.details() or ""), bad.details()
        assert not isinstance(plain, BaseException) and len(plain["tokens"]) == 6
        assert grammars.compiles == round_ + 1 and not grammars._compiled  # forgotten
    await system.wait_idle()


async def test_a_schema_compiles_once(system: System) -> None:
    stub = await system.add_worker()
    grammars = system.workers[0].engine.intake.grammars
    before = grammars.compiles
    outs = await asyncio.gather(
        *(generate(stub, constrained(prompt(i), schema(PERSON))) for i in range(4))
    )
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), PERSON)
    again = await generate(stub, constrained(prompt(9), schema(PERSON)))
    jsonschema.validate(json.loads(again["text"]), PERSON)
    assert grammars.compiles - before == 1


async def test_preempted_constrained_requests_keep_their_grammar_state(system: System) -> None:
    """A pool too small for every request at once: sequences are preempted and recomputed;
    each matcher keeps the state of the output it has, so every output still validates."""
    stub = await system.add_worker(num_blocks=24, max_step_tokens=32)
    jobs = [
        generate(stub, constrained(prompt(i, 40), schema(PERSON), temperature=1.0, seed=i))
        for i in range(8)
    ]
    outs = await asyncio.gather(*jobs)
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), PERSON)
    assert system.workers[0].engine.leases.preemptions > 0
    await system.wait_idle()


async def test_speculation_is_off_for_a_constrained_request(system: System) -> None:
    stub = await system.add_worker()
    out = await generate(
        stub, constrained(prompt(3), schema(PERSON), speculative=pb.SPECULATIVE_NGRAM)
    )
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert system.workers[0].engine.stats.draft_tokens == 0


# -- logit bias and penalties ------------------------------------------------------------------


def dense_greedy(p: list[int], n: int, processor) -> list[int]:
    """mlx-lm's dense path with ``processor(generated, logits)`` (an independent reading of
    the semantics) applied at every step."""
    ref = load_model(TINY_MODEL_NAME)

    def proc(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(tokens.tolist()[len(p) :], logits)

    return [
        int(t)
        for t, _ in generate_step(
            mx.array(p),
            ref.model,
            max_tokens=n,
            sampler=lambda x: mx.argmax(x, axis=-1),
            logits_processors=[proc],
        )
    ]


def vllm_penalties(presence: float, frequency: float, bias: dict[int, float]):
    def apply(generated: list[int], logits: mx.array) -> mx.array:
        add = [0.0] * logits.shape[-1]
        for t, b in bias.items():
            add[t] += b
        for t in set(generated):
            add[t] -= presence + frequency * generated.count(t)
        return logits + mx.array(add, dtype=logits.dtype)

    return apply


async def test_logit_bias_and_penalties_match_an_independent_dense_reading(
    system: System, reference
) -> None:
    stub = await system.add_worker()
    cases = [
        (0.0, 0.0, {7: 100.0}),
        (1.5, 0.0, {}),
        (0.0, 1.0, {}),
        (0.5, 0.7, {11: 3.0, 12: -100.0}),
        (-1.0, 0.0, {}),
    ]
    plain = prompt(50)
    jobs = [generate(stub, request(plain, max_tokens=16))]
    for k, (presence, frequency, bias) in enumerate(cases):
        jobs.append(
            generate(
                stub,
                request(
                    prompt(k),
                    max_tokens=16,
                    presence_penalty=presence,
                    frequency_penalty=frequency,
                    logit_bias=bias,
                ),
            )
        )
    outs = await asyncio.gather(*jobs)
    assert outs[0]["tokens"] == reference(plain, 16)[0]  # batched with them, unchanged
    assert outs[1]["tokens"] == [7] * 16
    for (presence, frequency, bias), out, k in zip(cases, outs[1:], range(len(cases)), strict=True):
        want = dense_greedy(prompt(k), 16, vllm_penalties(presence, frequency, bias))
        assert out["tokens"] == want, (presence, frequency, bias)
    await system.wait_idle()


async def test_logit_bias_out_of_range_is_invalid_argument(system: System) -> None:
    stub = await system.add_worker()
    vocab = (await stub.GetInfo(pb.GetInfoRequest())).vocab_size
    for kw, says in (
        ({"logit_bias": {vocab: 1.0}}, "vocabulary"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, request(prompt(1), **kw))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (info.value.details() or "")
    await system.wait_idle()
