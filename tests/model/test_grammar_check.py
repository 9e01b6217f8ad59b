"""Constraints checked in a child process (``kvserve_model.grammar_check``): what compiles
passes, what does not is its own error, and a child that crashes or hangs on one constraint
costs that constraint alone, never the process that asked."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from kvserve_model.grammar_check import GrammarChecker
from kvserve_model.structured_output import StructuredOutput, StructuredOutputError

# A child that answers as the real one does, but dies by SIGSEGV on the regex "crash" and
# never answers "hang": a stand-in for the engine's unknown faults, which the real child would
# meet the same way (llguidance 1.9.1 crashed so on a schema, now refused by its bounds).
FAULTY_CHILD = r"""
import json, os, signal, sys, time
for line in sys.stdin:
    spec = json.loads(line)["spec"]
    if spec == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if spec == "hang":
        time.sleep(3600)
    sys.stdout.write(json.dumps({"error": "bad: " + spec if spec.startswith("(") else ""}) + "\n")
    sys.stdout.flush()
"""


def regex(spec: str) -> StructuredOutput:
    return StructuredOutput("regex", spec)


async def test_the_real_child_passes_what_compiles_and_names_what_does_not() -> None:
    checker = GrammarChecker()
    try:
        await checker.check(StructuredOutput.json_schema({"type": "object"}))
        await checker.check(StructuredOutput("choice", choices=("yes", "no")))
        with pytest.raises(StructuredOutputError, match="does not compile"):
            await checker.check(StructuredOutput("grammar", "start: nothing_defined"))
        with pytest.raises(StructuredOutputError, match="beyond ±2\\^53"):
            await checker.check(StructuredOutput.json_schema({"maximum": 10**20}))
        # Cached, errors too: a popular constraint goes to the child once.
        assert checker.runs == 4
        await checker.check(StructuredOutput.json_schema({"type": "object"}))
        with pytest.raises(StructuredOutputError, match="does not compile"):
            await checker.check(StructuredOutput("grammar", "start: nothing_defined"))
        assert checker.runs == 4
        assert checker.children == 1
    finally:
        await checker.close()


async def test_a_lark_grammar_embedding_the_crashing_schema_is_an_error_not_an_exit() -> None:
    """The bounds rule reads JSON schemas; a Lark grammar's ``%json{}`` is not one, so it
    reaches the engine, which crashed on it (1.9.1). Whatever the engine's version does with
    it, the checker answers, and checks on after it."""
    crashing = '{"type":"integer","minimum":-9223372036854775807,"maximum":-9223372036854775803}'
    checker = GrammarChecker()
    try:
        try:
            await checker.check(StructuredOutput("grammar", f"start: %json{crashing}\n"))
        except StructuredOutputError as e:
            assert "grammar" in str(e)
        await checker.check(regex("[a-z]+"))
    finally:
        await checker.close()


async def test_a_crash_is_that_constraints_error_and_the_next_check_gets_a_new_child() -> None:
    checker = GrammarChecker(command=[sys.executable, "-c", FAULTY_CHILD])
    try:
        await checker.check(regex("ok"))
        with pytest.raises(StructuredOutputError, match=r"crashed the grammar engine \(SIGSEGV\)"):
            await checker.check(regex("crash"))
        with pytest.raises(StructuredOutputError, match="crashed"):  # cached: no second crash
            await checker.check(regex("crash"))
        with pytest.raises(StructuredOutputError, match="bad: \\(x"):
            await checker.check(regex("(x"))
        assert checker.children == 2
    finally:
        await checker.close()


async def test_checks_waiting_behind_a_crash_are_answered() -> None:
    checker = GrammarChecker(command=[sys.executable, "-c", FAULTY_CHILD])
    try:
        specs = ["a", "crash", "b", "(c", "d"]
        results = await asyncio.gather(
            *(checker.check(regex(s)) for s in specs), return_exceptions=True
        )
        assert results[0] is None and results[2] is None and results[4] is None
        assert isinstance(results[1], StructuredOutputError) and "crashed" in str(results[1])
        assert isinstance(results[3], StructuredOutputError) and "bad" in str(results[3])
    finally:
        await checker.close()


async def test_a_compile_past_the_timeout_is_its_error_and_the_child_is_replaced() -> None:
    checker = GrammarChecker(timeout_s=1.0, command=[sys.executable, "-c", FAULTY_CHILD])
    try:
        await checker.check(regex("warm"))  # the child's start is not the hang's time
        with pytest.raises(StructuredOutputError, match="took longer than 1 s"):
            await checker.check(regex("hang"))
        await checker.check(regex("after"))
        assert checker.children == 2
    finally:
        await checker.close()


async def test_the_cache_is_bounded() -> None:
    checker = GrammarChecker(cache_size=2, command=[sys.executable, "-c", FAULTY_CHILD])
    try:
        for s in ("a", "b", "c", "a"):  # "a" fell out when "c" came
            await checker.check(regex(s))
        assert checker.runs == 4
        await checker.check(regex("a"))
        assert checker.runs == 4
    finally:
        await checker.close()


def test_the_child_protocol_is_one_json_line_each_way() -> None:
    """The real child, driven by hand: what the parent sends and reads."""
    import subprocess

    so = StructuredOutput("regex", "[0-9]+\n(")
    line = json.dumps({"kind": so.kind, "spec": so.spec, "choices": []})
    out = subprocess.run(
        [sys.executable, "-m", "kvserve_model.grammar_check"],
        input=line + "\n" + line.replace("\\n(", "") + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 2
    assert json.loads(out[0])["error"].startswith("the regex does not compile")
    assert json.loads(out[1]) == {"error": ""}
