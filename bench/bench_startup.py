"""Startup benchmark: how long ``make run`` takes to answer, where the time goes, and the peer.

Starts the whole system as ``make run`` does (``python -m kvserve_launch``, one worker, any free
ports) and timestamps every line the processes print, from the spawn of the launcher:

- ``cache ready``, ``gateway ready`` (it serves, answering 503 until a worker is ready),
  ``worker ready``, ``system ready`` (the launcher's ``KVSERVE_READY``: every worker ready and
  the gateway's /health ok);
- the worker's phases from its own log lines: BLAS (choice and a matmul's speed), model load
  (the GGUF conversion and its check included on a first start), pool and decode-attention
  choice, self-check, and the background warm-up (after ready, not on the path);
- the first chat completion sent the moment the system is ready (greedy, 24 tokens, streamed):
  its first text, its end, and its answer.

Each round starts twice: **first** with an empty models cache (``KVSERVE_MODEL_DIR``: the GGUF
converts), an empty MLX kernel cache (``TMPDIR``; on CUDA also the driver's, ``CUDA_CACHE_PATH``) and the
BLAS probed again (what a new machine pays), then **second** with what the first left (a restart). The peer in the same run:
``mlx_lm.server`` on the same model directory and BLAS, from its spawn until it answers the same
request.

    python bench/bench_startup.py                 # the default model, 3 rounds
    python bench/bench_startup.py --model kvserve-tiny-llama --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve_model.blas import fast_blas_env  # noqa: E402
from kvserve_model.default_model import DEFAULT_MODEL_NAME  # noqa: E402

QUESTION = "What is the capital of France?"
# (column, pattern of a worker log line, the group that holds its seconds; None: the line's time)
PHASES = (
    ("BLAS", r"worker-0 \| .* BLAS: ", None),
    ("model load", r"model loaded in ([0-9.]+) s", 1),
    ("tokenizer (thread)", r"tokenizer loaded in ([0-9.]+) s", 1),
    ("self-check", r"self-check passed: .* in ([0-9.]+) s", 1),
    ("warm-up (background)", r"warm-up: .* in ([0-9.]+) s", 1),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(http: str, model: str, timeout_s: float = 300.0) -> tuple[float, float, str]:
    """The question, streamed: (seconds to the first text, seconds to the end, the answer).
    A first token that arrives with the last one shows as TTFT close to the total."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{http}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, parts = 0.0, []
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            text = choices[0].get("delta", {}).get("content")
            if text:
                first = first or time.perf_counter() - t0
                parts.append(text)
    return first, time.perf_counter() - t0, "".join(parts)


class Timeline:
    """Every line a process printed, with seconds since its spawn."""

    def __init__(self, proc: subprocess.Popen[str], t0: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self.t0 = t0
        self.proc = proc
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line.rstrip()))
        self._done.set()

    def wait_for(self, pattern: str, timeout_s: float) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for t, line in self.lines[seen:]:
                if m := re.search(pattern, line):
                    return t, m
            seen = len(self.lines)
            if self._done.is_set() and seen == len(self.lines):
                break
            time.sleep(0.02)
        tail = "\n".join(line for _, line in self.lines[-30:])
        raise RuntimeError(f"no line matching {pattern!r}; the last lines:\n{tail}")

    def find(self, pattern: str) -> tuple[float, re.Match[str]] | None:
        for t, line in self.lines:
            if m := re.search(pattern, line):
                return t, m
        return None


def kvserve_start(
    model: str, env: dict[str, str], log: Path | None = None
) -> dict[str, float | str]:
    cmd = [
        sys.executable, "-m", "kvserve_launch", "--model", model, "--workers", "1",
        "--http-port", "0", "--grpc-port", "0", "--cache-port", "0",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timeline = Timeline(proc, t0)
    try:
        ready, m = timeline.wait_for(r"KVSERVE_READY http=(\S+)", 600)
        ttft, total, answer = chat(f"http://{m.group(1)}", model)
        row: dict[str, float | str] = {"system ready": ready}
        for name, pattern in (
            ("cache ready", r"^cache +\| .*listening on"),
            ("gateway ready", r"^gateway +\| .*serving "),
            ("worker ready", r"^worker-0 \| .*worker worker-0 serving"),
        ):
            found = timeline.find(pattern)
            row[name] = found[0] if found else float("nan")
        for name, pattern, group in PHASES:
            found = timeline.find(pattern)
            if name.startswith("warm-up"):  # after ready: wait for it, within reason
                try:
                    found = timeline.wait_for(pattern, 120)
                except RuntimeError:
                    found = None
            if found is None:
                row[name] = float("nan")
            else:
                row[name] = float(found[1].group(group)) if group else found[0]
        row["first request TTFT"] = ttft
        row["first request"] = total
        row["answer"] = answer
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None:
            log.write_text("".join(f"{t:8.2f} {line}\n" for t, line in timeline.lines))


def peer_start(model_dir: Path, env: dict[str, str]) -> dict[str, float | str]:
    """``mlx_lm.server`` on the same directory: spawn until it answers the same request."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("mlx_lm.server exited")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - t0
        ttft, total, answer = chat(f"http://127.0.0.1:{port}", str(model_dir))
        return {
            "system ready": ready,
            "first request TTFT": ttft,
            "first request": total,
            "answer": answer,
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    p.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    p.add_argument("--first-only", action="store_true", help="only the first start")
    p.add_argument("--logs", type=Path, help="write each start's timestamped lines here")
    a = p.parse_args()
    rows: dict[str, list[dict[str, float | str]]] = {}
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            models, kernels = Path(tmp) / f"models-{r}", Path(tmp) / f"tmp-{r}"
            kernels.mkdir()
            # CUDA_CACHE_PATH: the driver's own cache of kernels built from PTX (~/.nv), which
            # a new machine does not have either.
            env = {
                **os.environ,
                "KVSERVE_MODEL_DIR": str(models),
                "TMPDIR": str(kernels),
                "CUDA_CACHE_PATH": str(kernels / "nv"),
            }
            for start in ("first",) if a.first_only else ("first", "second"):
                # A first start probes the BLAS again, as on a new machine.
                run_env = {**env, "KVSERVE_BLAS_REPROBE": "1"} if start == "first" else env
                log = a.logs / f"round{r + 1}-{start}.log" if a.logs else None
                row = kvserve_start(a.model, run_env, log)
                rows.setdefault(f"kvserve, {start} start", []).append(row)
                print(f"# round {r + 1}, {start} start: {row}", file=sys.stderr)
            if not a.no_peer:
                from kvserve_model.resolve import resolve_model

                os.environ["KVSERVE_MODEL_DIR"] = str(models)
                model_dir = resolve_model(a.model)
                row = peer_start(model_dir, fast_blas_env(env))
                rows.setdefault("mlx_lm.server (same model, same BLAS)", []).append(row)
                print(f"# round {r + 1}, peer: {row}", file=sys.stderr)
            shutil.rmtree(models, ignore_errors=True)
    print(f"# {a.model}: seconds from spawn, median of {a.rounds} rounds\n")
    cols = [
        "cache ready", "gateway ready", "worker ready", "system ready", "BLAS", "model load",
        "tokenizer (thread)", "self-check", "warm-up (background)", "first request TTFT", "first request",
    ]  # fmt: skip
    print("| start | " + " | ".join(cols) + " | answer |")
    print("|---|" + "---|" * (len(cols) + 1))
    for name, runs in rows.items():
        cells = []
        for c in cols:
            values = [float(run[c]) for run in runs if c in run]
            cells.append(f"{statistics.median(values):.2f}" if values else "")
        print(f"| {name} | " + " | ".join(cells) + f" | {runs[-1]['answer']!r} |")


if __name__ == "__main__":
    main()
