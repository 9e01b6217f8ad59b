"""What checking a constraint in a child process costs (``kvserve_model.grammar_check``).

The gateway and the worker check each new constraint's grammar in a child process, so that a
crash of the engine (llguidance 1.9.1 on a schema whose bounds round to int64's smallest) is
that request's error, not the service's end. Against the baseline, the same check in-process
(``StructuredOutput.check``), on the schema suite of ``bench/structured_schemas.py``:

- **first check**: the child's start (a Python interpreter importing llguidance) and one check;
- **check, uncached**: every schema of the suite sent to the running child (its cache off),
  median and max per check; **in-process**: the same checks in this process;
- **cached**: a constraint checked before, from the checker's cache.

    .venv/bin/python bench/bench_grammar_check.py --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_schemas import SCHEMAS
from kvserve_model.grammar_check import GrammarChecker
from kvserve_model.structured_output import StructuredOutput


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.2f} / {1e3 * max(xs):.2f}"


async def run(repeat: int) -> None:
    suite = [StructuredOutput.json_schema(s.schema) for s in SCHEMAS]
    inproc: list[float] = []
    for _ in range(repeat):
        for so in suite:
            t = time.perf_counter()
            so.check()
            inproc.append(time.perf_counter() - t)

    checker = GrammarChecker(cache_size=0)
    t = time.perf_counter()
    await checker.check(suite[0])
    first = time.perf_counter() - t
    child: list[float] = []
    for _ in range(repeat):
        for so in suite:
            t = time.perf_counter()
            await checker.check(so)
            child.append(time.perf_counter() - t)
    await checker.close()

    cached_checker = GrammarChecker()
    await cached_checker.check(suite[0])
    cached: list[float] = []
    for _ in range(repeat * len(suite)):
        t = time.perf_counter()
        await cached_checker.check(suite[0])
        cached.append(time.perf_counter() - t)
    await cached_checker.close()

    print(f"{len(suite)} schemas x {repeat}; ms, median / max")
    print("| check | ms | vs in-process (median) |")
    print("|---|---:|---:|")
    base = statistics.median(inproc)
    print(f"| in-process (baseline) | {ms(inproc)} | 1.00x |")
    print(f"| child, uncached | {ms(child)} | {statistics.median(child) / base:.2f}x |")
    print(f"| child's first (start + check) | {1e3 * first:.1f} | |")
    print(f"| cached | {ms(cached)} | {statistics.median(cached) / base:.3f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    asyncio.run(run(p.parse_args().repeat))


if __name__ == "__main__":
    main()
