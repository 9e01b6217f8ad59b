"""Constraints checked in a child process, so that the grammar engine cannot take a service
down with it.

llguidance is native code. A JSON schema whose integer bounds both round to int64's minimum
made its grammar compiler dereference bad memory (SIGSEGV, llguidance 1.9.1): the gateway,
which checks every constraint before dispatch, died with every request it was serving, and a
few such requests stopped the whole system. Bounds like those are refused before the engine
sees them (``structured_output.check_bounds``), but a Lark grammar can embed JSON schemas
(``%json{...}``) and the engine's other faults are not known in advance. So the first compile
of a constraint, the one that can fail, runs here in a child (``python -m
kvserve_model.grammar_check``): a crash there, or a compile that runs past ``timeout_s``, is
that constraint's error (a 400 naming it) and the next check starts a fresh child. A
constraint that compiled in the child is then compiled in-process by the worker with its
tokenizer (the same grammar compiler).

The child is started at the first check (a service with no constrained requests has none),
serves checks one at a time over its stdin and stdout (one JSON line each way), and exits when
its parent does (its stdin closes). Results are cached by the constraint's digest, so a
popular schema is checked once per process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvserve_model.structured_output import StructuredOutput, StructuredOutputError

TIMEOUT_S = 10.0
CACHE_SIZE = 4096
MAX_ERROR_CHARS = 2000
_ROOT = str(Path(__file__).resolve().parent.parent)


def _digest(so: StructuredOutput) -> bytes:
    h = hashlib.sha256(so.kind.encode())
    h.update(b"\0" + so.spec.encode("utf-8", "surrogatepass"))
    for c in so.choices:
        h.update(b"\0" + c.encode("utf-8", "surrogatepass"))
    return h.digest()


class GrammarChecker:
    """Checks constraints in a child process (see the module's text); one per process that
    checks constraints. ``check`` is a coroutine: the checks of one checker run one at a time,
    in the order they came. ``command``: the child's, by default this module's :func:`serve`
    (tests give one that crashes on cue)."""

    def __init__(
        self,
        timeout_s: float = TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        command: Sequence[str] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.command = list(command or [sys.executable, "-m", "kvserve_model.grammar_check"])
        self._cache: OrderedDict[bytes, str] = OrderedDict()  # digest -> error ("" compiles)
        self._child: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        self.children = 0  # children started (a crash or a timeout costs one), for tests
        self.runs = 0  # constraints sent to a child (cache misses), for tests

    async def check(self, so: StructuredOutput) -> None:
        """Returns once ``so`` compiles; raises StructuredOutputError naming the problem,
        including a crash of the engine or a compile past ``timeout_s``."""
        key = _digest(so)
        error = self._cached(key)
        if error is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                error = self._cached(key)
                if error is None:
                    error = await self._run(so)
                    self._cache[key] = error
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        if error:
            raise StructuredOutputError(error)

    def _cached(self, key: bytes) -> str | None:
        error = self._cache.get(key)
        if error is not None:
            self._cache.move_to_end(key)
        return error

    async def _run(self, so: StructuredOutput) -> str:
        child = await self._started()
        self.runs += 1
        assert child.stdin is not None and child.stdout is not None
        line = json.dumps({"kind": so.kind, "spec": so.spec, "choices": list(so.choices)})
        try:
            child.stdin.write(line.encode() + b"\n")
            await child.stdin.drain()
            reply = await asyncio.wait_for(child.stdout.readline(), self.timeout_s)
        except TimeoutError:
            await self._stop()
            return f"the {so.name} took longer than {self.timeout_s:g} s to compile"
        except (ConnectionError, OSError):
            reply = b""
        if not reply:  # the child died on this constraint
            code = await child.wait()
            self._child = None
            how = _signal_name(code)
            return f"compiling the {so.name} crashed the grammar engine ({how}); it is refused"
        return str(json.loads(reply)["error"])

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is None or self._child.returncode is not None:
            env = dict(os.environ)
            path = env.get("PYTHONPATH")
            env["PYTHONPATH"] = _ROOT + (os.pathsep + path if path else "")
            self._child = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                limit=1 << 20,
            )
            self.children += 1
        return self._child

    async def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()

    async def close(self) -> None:
        """Stops the child, if one runs; a later check starts another."""
        await self._stop()


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _error(so: StructuredOutput) -> str:
    try:
        so.check()
    except StructuredOutputError as e:
        return str(e)[:MAX_ERROR_CHARS] or f"the {so.name} does not compile"
    except Exception as e:  # the engine's own failures are the constraint's, not the child's
        return f"the {so.name} does not compile: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
    return ""


def serve() -> None:
    """The child: one JSON line in (a constraint), one out (``{"error": ...}``, "" when it
    compiles), until stdin closes. Anything else written to stdout (the engine's own output)
    goes to stderr instead, out of the replies."""
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        msg = json.loads(line)
        so = StructuredOutput(msg["kind"], msg["spec"], tuple(msg["choices"]))
        replies.write(json.dumps({"error": _error(so)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
