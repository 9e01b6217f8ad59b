"""A worker group as real processes (issue 36): the launcher's ``--tensor-parallel 2`` starts a
worker that starts its second rank (``python -m worker.follower``) over MLX's ring backend on
loopback; the group registers one pool and serves what one process serves, token for token
(fp32, greedy); a rank that dies takes the worker down, which says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest

from kvserve_launch.process import Child, KeptLines
from tests.e2e.conftest import ADMIN_TOKEN, STARTUP_TIMEOUT_S, TINY_MODEL_NAME, started_system
from tests.e2e.test_faults import port
from worker.group_launch import free_ports

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.skipif(mx.default_device() == mx.gpu, reason="the CPU ring group; GPUs: NCCL"),
]

SHARED = "You are a helpful assistant who answers in one short line. " * 3
PROMPTS = [SHARED + q for q in ("Name a color.", "Count to three.", "Say hi.", "Why?")]


def _complete(base: str, prompt: str, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _serve(tensor_parallel: int, logs: KeptLines) -> tuple[list[str], list[dict], dict]:
    """Four concurrent greedy completions sharing a prefix, then the first again (a cache hit),
    then one decoded speculatively by prompt lookup and one by a draft model; their texts,
    usages, and the pool's stats."""
    fixture = started_system(logs, workers=1, tensor_parallel=tensor_parallel)
    system = next(fixture)
    base = f"http://{system.http_address}"
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: _complete(base, p), PROMPTS))
        answers.append(_complete(base, PROMPTS[0]))
        # Speculative decoding by prompt lookup: the verify forwards run on both ranks too.
        answers.append(_complete(base, PROMPTS[1] + " " + PROMPTS[1], speculative="ngram"))
        # ... and by a draft model (unsharded, on rank 0 only; a worker without one refuses).
        answers.append(_complete(base, PROMPTS[2], speculative="draft_model"))
        stats = httpx.get(
            f"{base}/admin/dashboard/stats",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        ).json()
        return [a["choices"][0]["text"] for a in answers], [a["usage"] for a in answers], stats
    finally:
        fixture.close()


def test_a_two_rank_worker_serves_what_one_process_serves(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where rank 0 writes the ring's hosts file
    monkeypatch.setenv("KVWORKER_DRAFT_MODEL", TINY_MODEL_NAME)  # drafts that always agree
    logs = KeptLines(20_000)
    texts, usages, stats = _serve(2, logs)
    assert not list(tmp_path.glob("kvserve-group-*")), "the hosts file was left behind"
    lines = logs.dump()
    assert "worker group: 2 ranks over ring; this process is rank 0" in lines, lines[-3000:]
    assert "worker group: rank 1 of 2 joined" in lines
    assert "tensor parallel over 2 ranks" in lines
    assert "self-check passed" in lines
    pools = json.dumps(stats)
    assert pools.count("worker-0") >= 1  # one pool for the group
    one_texts, one_usages, _ = _serve(1, KeptLines(20_000))
    assert texts == one_texts
    assert usages[4]["prompt_tokens_details"]["cached_tokens"] > 0  # the group reuses blocks
    assert [u["completion_tokens"] for u in usages] == [u["completion_tokens"] for u in one_usages]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_rank_that_dies_takes_the_worker_down():
    logs = KeptLines(20_000)
    fixture = started_system(logs, workers=1, tensor_parallel=2)
    system = next(fixture)
    try:
        worker = system.workers[0].process
        assert worker is not None
        followers = [p for p in _children(worker.pid) if "worker.follower" in _cmdline(p)]
        assert len(followers) == 1, logs.dump()[-3000:]
        os.kill(followers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker.poll() == 1, logs.dump()[-3000:]
        assert "rank 1 exited" in logs.dump()
    finally:
        fixture.close()


def test_a_rank_that_stops_answering_takes_the_worker_down(monkeypatch):
    """A follower that hangs (SIGSTOP: alive, silent) leaves rank 0 inside a collective; past
    ``--group-timeout-s`` (5 s here: a tiny model's steps take milliseconds) rank 0 says so
    and exits 1, as if the rank had died."""
    monkeypatch.setenv("KVWORKER_GROUP_TIMEOUT_S", "5")
    logs = KeptLines(20_000)
    fixture = started_system(logs, workers=1, tensor_parallel=2)
    system = next(fixture)
    stopped: list[int] = []
    try:
        worker = system.workers[0].process
        assert worker is not None
        base = f"http://{system.http_address}"
        _complete(base, PROMPTS[0])  # the group serves
        followers = [p for p in _children(worker.pid) if "worker.follower" in _cmdline(p)]
        assert len(followers) == 1, logs.dump()[-3000:]
        os.kill(followers[0], signal.SIGSTOP)
        stopped.append(followers[0])
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.post,
                f"{base}/v1/completions",
                timeout=60,
                json={"prompt": PROMPTS[1], "max_tokens": 8},
            )
            deadline = time.monotonic() + 40
            while worker.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert worker.poll() == 1, logs.dump()[-3000:]
            assert "stopped answering" in logs.dump()
            assert pending.result().status_code >= 500  # the request fails; it is not hung
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        fixture.close()


def _answer_when_reachable(base: str, prompt: str) -> dict:
    """A completion, retried while the gateway finds the worker started again."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return _complete(base, prompt)
        except (AssertionError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _start_ranks(single: Child, worker_port: str, tmp_path, timeout_s: int) -> list[Child]:
    """A group of 2 in place of the one-process worker ``single`` (on its port), each rank
    started on its own: rank 0 as ``mlx.launch`` starts it (``MLX_RANK`` and a hosts file),
    rank 1 as a pod a rank does (``--group-hosts`` and ``--group-rank``)."""
    names = [f"localhost:{p}" for p in free_ports(2)]
    hosts = tmp_path / f"hosts-{names[0].rpartition(':')[2]}.json"
    hosts.write_text(json.dumps([[name] for name in names]))
    argv = list(single.argv)
    argv[argv.index("--port") + 1] = worker_port
    argv += ["--tensor-parallel", "2"]
    env = {**single.env, "KVWORKER_GROUP_TIMEOUT_S": str(timeout_s)}
    by_rank = [
        {"MLX_HOSTFILE": str(hosts), "MLX_RANK": "0"},
        {"KVWORKER_GROUP_HOSTS": ",".join(names), "KVWORKER_GROUP_RANK": "1"},
    ]
    ranks = []
    for rank, own in enumerate(by_rank):
        child = Child(
            f"rank{rank}",
            argv,
            ready_prefix=single.ready_prefix if rank == 0 else "never",
            env={**env, **own},
            sink=single.sink,
        )
        ranks.append(child.start())
    ranks[0].wait_ready(STARTUP_TIMEOUT_S)
    return ranks


def _exits(child: Child, within_s: float = 30) -> int | None:
    deadline = time.monotonic() + within_s
    while child.running and time.monotonic() < deadline:
        time.sleep(0.2)
    return child.returncode


def test_ranks_started_on_their_own_form_a_group_and_outlive_no_peer(tmp_path):
    """Several machines: every rank runs the worker's own command, started on its own, and
    finds the others by name (``localhost`` here, a pod's DNS name in a cluster). Rank 0
    registers the one pool and answers what one process answers; the other follows. Then each
    way a peer can vanish: the follower killed, and rank 0 exits 1 (a failed ping, or a step
    past its bound);
    rank 0 stopped without closing its sockets (SIGSTOP: its machine lost), and the follower,
    hearing neither calls nor pings past its bound, exits 1 rather than waiting in a
    collective forever."""
    logs = KeptLines(20_000)
    fixture = started_system(logs, workers=1)
    system = next(fixture)
    ranks: list[Child] = []
    try:
        base = f"http://{system.http_address}"
        alone = [_complete(base, p)["choices"][0]["text"] for p in PROMPTS[:2]]
        single = system.workers[0]
        single.stop()
        worker_port = port(system.worker_addresses[0])
        ranks += _start_ranks(single, worker_port, tmp_path, timeout_s=10)
        grouped = [_answer_when_reachable(base, p)["choices"][0]["text"] for p in PROMPTS[:2]]
        assert grouped == alone
        lines = logs.dump()
        assert "worker group: rank 1 of 2 joined" in lines, lines[-3000:]
        assert "tensor parallel over 2 ranks" in lines
        deadline = time.monotonic() + 60  # idle: the background warm-up over
        while "start-up over" not in logs.dump() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks[1].kill()  # the follower's machine gone, its sockets closed
        assert _exits(ranks[0]) == 1, logs.dump()[-3000:]
        # Idle, a ping fails; inside a step the ring reports the closed socket but the step's
        # evaluation did not return here, and the stall watch ends it.
        said = logs.dump()
        assert "a rank is gone" in said or "a rank stopped answering" in said, said[-3000:]
        ranks += _start_ranks(single, worker_port, tmp_path, timeout_s=10)
        time.sleep(2)  # idle: the follower waits for rank 0
        assert ranks[3].running
        ranks[2].signal(signal.SIGSTOP)
        assert _exits(ranks[3]) == 1, logs.dump()[-3000:]
        assert "nothing from rank 0" in logs.dump()
    finally:
        for child in ranks:
            with contextlib.suppress(Exception):
                child.signal(signal.SIGCONT)
                child.stop(grace_s=2)
        fixture.close()
