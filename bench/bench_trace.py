"""Cache-authority trace replay: domain time per request on a seeded server trace (issue 12).

The trace (seeded, so every engine replays the same requests):
  - a new conversation opens with one of `--systems` system prompts (Zipf, exponent `--zipf`,
    each `--system-tokens` long) and a user turn;
  - with probability `--follow-up`, a request continues one of the `--open` most recent
    conversations instead: its whole history (every earlier prompt and answer) plus a user
    turn, so a chat's history is what it reuses; a conversation past `--max-context` closes;
  - every request generates `--generated` tokens; all tokens are random in [0, 32000).
The pool holds `--pool-tokens` tokens in blocks of `--block-size`, far less than the trace
touches, so eviction runs all the time.

The replay drives `CacheAuthority` in process as a worker would, about four requests in
flight: a request acquires its prompt (a `--reserve`-token decode reserve, defer allowed) at
step t, commits its prompt at t+1, extends to its whole sequence at t+2 and releases with its
generated tokens at t+3; a Deferral retries at the end of its step, once that step's commits
are in. The token ids reach the domain as the gRPC servicer hands them over (`--inputs
servicer`: a tuple to acquire, protobuf repeated fields to commit and release) or as Python
lists (`--inputs lists`). Every domain call is timed in the thread's CPU time
(`thread_time_ns`, less the cost of reading that clock), so that other processes on a shared
machine stay out of the numbers (`--wall`: wall clock); `check_integrity()` must be clean at
the end.

Each engine runs in its own fresh subprocess on the same trace:
  - `kvserve`: this checkout's `kvcache_service`;
  - `baseline`: another checkout's (`--baseline DIR`, e.g. HEAD archived to /tmp/kvbase);
  - `naive`: a dict of block hashes with LRU eviction, written here as a reference point.

    git -C . archive HEAD | tar -x -C /tmp/kvbase      # (mkdir /tmp/kvbase first)
    .venv/bin/python bench/bench_trace.py --quick --baseline /tmp/kvbase        # seconds
    .venv/bin/python bench/bench_trace.py --baseline /tmp/kvbase --naive --repeat 3
    .venv/bin/python bench/bench_trace.py --profile --baseline /tmp/kvbase     # where time goes
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib
import json
import pstats
import resource
import statistics
import subprocess
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32000
OPS = ("acquire", "commit", "extend", "release")
CLOCK = time.thread_time_ns  # the child's, set by --wall


def clock_cost(clock) -> int:
    """What reading `clock` twice costs (ns): subtracted from every sample."""
    samples = []
    for _ in range(2000):
        t0 = clock()
        samples.append(clock() - t0)
    return sorted(samples)[len(samples) // 2]


# -- the trace --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    seed: int = 0
    requests: int = 20_000
    systems: int = 200
    system_tokens: tuple[int, int] = (1000, 2000)
    zipf: float = 0.8
    follow_up: float = 0.5
    open: int = 400  # conversations a follow-up may continue (the most recent ones)
    user_tokens: tuple[int, int] = (20, 200)
    generated: tuple[int, int] = (20, 400)
    max_context: int = 8192
    block_size: int = 32
    pool_tokens: int = 200_000
    reserve: int = 64
    # What the domain is handed: "servicer", what the gRPC servicer passes it (in a checkout
    # that speaks wire revision 2, the compact form: packed prompts, a commit with no token,
    # a release with only the generated ones, converted as convert.py does; in one that does
    # not, a tuple to acquire and protobuf repeated fields to commit and release); or "lists",
    # Python lists everywhere (an in-process caller).
    inputs: str = "servicer"


@dataclass(slots=True)
class Request:
    """One request, shaped as `TraceSpec.inputs` says: its prompt for acquire, its prompt
    again for commit, the prompt and the generated tokens for release; and in the compact
    wire form, the packed prompt and the packed generated tokens."""

    prompt: Sequence[int]
    commit: Sequence[int]
    release: Sequence[int]
    prompt_wire: bytes = b""
    answer_wire: bytes = b""


def shaped(prompt: np.ndarray, answer: np.ndarray, inputs: str) -> Request:
    p, full = prompt.tolist(), prompt.tolist() + answer.tolist()
    if inputs == "lists":
        return Request(p, p, full)
    from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

    return Request(
        tuple(p),
        pb.CommitItem(token_ids=p).token_ids,
        pb.ReleaseLeaseRequest(token_ids=full).token_ids,
        prompt.astype("<u4").tobytes(),
        answer.astype("<u4").tobytes(),
    )


def trace(spec: TraceSpec) -> Iterator[Request]:
    """The requests of `spec`, in arrival order. Deterministic: it never looks at a cache."""
    rng = np.random.default_rng(spec.seed)
    lengths = rng.integers(spec.system_tokens[0], spec.system_tokens[1] + 1, spec.systems)
    systems = [rng.integers(0, VOCAB, n, dtype=np.int32) for n in lengths]
    weights = 1.0 / np.arange(1, spec.systems + 1) ** spec.zipf
    weights /= weights.sum()
    picks = rng.choice(spec.systems, size=spec.requests, p=weights)
    # Histories as int32 arrays (4 bytes a token): the trace's own memory stays small.
    conversations: list[np.ndarray] = []

    def span(lo_hi: tuple[int, int]) -> np.ndarray:
        return rng.integers(0, VOCAB, int(rng.integers(lo_hi[0], lo_hi[1] + 1)), dtype=np.int32)

    for i in range(spec.requests):
        user, answer = span(spec.user_tokens), span(spec.generated)
        if conversations and rng.random() < spec.follow_up:
            k = len(conversations) - 1 - int(rng.integers(0, min(spec.open, len(conversations))))
            prompt = np.concatenate([conversations[k], user])
            if len(prompt) + len(answer) > spec.max_context:
                conversations.pop(k)  # closed: the next one starts over
                prompt = np.concatenate([systems[picks[i]], user])
            else:
                conversations.pop(k)
        else:
            prompt = np.concatenate([systems[picks[i]], user])
        conversations.append(np.concatenate([prompt, answer]))
        if len(conversations) > spec.open:
            conversations.pop(0)
        yield shaped(prompt, answer, spec.inputs)


# -- engines ----------------------------------------------------------------------------------


class Deferred(Exception):
    pass


class Refused(Exception):
    pass


class KvserveEngine:
    """`CacheAuthority` of whichever `kvcache_service` is first on sys.path, handed what that
    checkout's servicer would hand it (`TraceSpec.inputs`)."""

    def __init__(self, spec: TraceSpec) -> None:
        authority = importlib.import_module("kvcache_service.authority")
        self.errors = importlib.import_module("kvcache_service.errors")
        self.leases = importlib.import_module("kvcache_service.leases")
        pool = importlib.import_module("kvcache_service.pool")
        self.now = 1000.0
        self.auth = authority.CacheAuthority(
            authority.AuthorityConfig(lease_ttl_s=1e9, max_pool_blocks=1 << 24),
            clock=lambda: self.now,
        )
        num_blocks = spec.pool_tokens // spec.block_size
        self.inc = self.auth.register_pool(
            pool.PoolSpec("w", num_blocks, spec.block_size)
        ).incarnation
        self.reserve = spec.reserve
        self.reuse = self.leases.Reuse.SHARE_OR_DEFER
        # Wire revision 2: the edge packs token ids (convert.py) and commits and releases
        # carry sequence updates; before it, the authority took the sequences as they came.
        self.revision2 = hasattr(self.leases, "SequenceUpdate")
        self.compact = self.revision2 and spec.inputs == "servicer"
        if self.revision2:
            self.convert = importlib.import_module("kvcache_service.convert")
            self.pack = importlib.import_module("kvcache_service.tokens").pack

    def acquire(self, r: Request) -> tuple[int, int]:
        if self.compact:
            prompt = self.convert.tokens((), r.prompt_wire, "prompt")
        elif self.revision2:
            prompt = self.pack(r.prompt, "prompt")
        else:
            prompt = r.prompt
        req = self.leases.AcquireRequest("w", self.inc, "", prompt, self.reserve, self.reuse)
        try:
            result, _ = self.auth.acquire(req)
        except self.errors.OutOfBlocks as err:
            raise Refused from err
        if isinstance(result, self.leases.Deferral):
            raise Deferred
        return result.lease_id, result.cached_tokens

    def _update(self, tokens: Sequence[int]):  # type: ignore[no-untyped-def]
        return self.leases.SequenceUpdate.whole(self.pack(tokens, "token_ids"))

    def commit(self, lease: int, r: Request) -> None:
        if self.compact:  # the prompt's blocks: the lease knows every token of them
            update = self.leases.SequenceUpdate(len(r.prompt))
        elif self.revision2:
            update = self._update(r.commit)
        else:
            update = r.commit
        self.auth.commit("w", self.inc, [(lease, update)])

    def extend(self, lease: int, num_tokens: int) -> None:
        try:
            self.auth.extend("w", self.inc, [(lease, num_tokens)])
        except self.errors.OutOfBlocks as err:
            raise Refused from err

    def release(self, lease: int, r: Request) -> None:
        if self.compact:  # only the generated tokens travel
            n = len(r.prompt)
            answer = self.convert.tokens((), r.answer_wire, "appended_tokens", allow_empty=True)
            update = self.leases.SequenceUpdate(n + len(answer) // 4, answer, n)
        elif self.revision2:
            update = self._update(r.release)
        else:
            update = r.release
        self.auth.release("w", self.inc, lease, update)

    def tick(self) -> None:
        self.now += 0.001

    def finish(self) -> dict[str, object]:
        pool = self.auth.pools["w"]
        return {
            "evicted": pool.counters.evicted_blocks,
            "indexed": len(pool.index),
            "problems": self.auth.check_integrity(),
        }


class VerifyingEngine(KvserveEngine):
    """KvserveEngine that digests everything the domain answers (grants' block tables,
    cached tokens and copy-on-write pairs, deferrals, new blocks, indexed tokens): two
    checkouts that behave alike produce the same digest on the same trace. Slower: `--verify`
    reports it apart from the timings."""

    def __init__(self, spec: TraceSpec) -> None:
        super().__init__(spec)
        self.digest = hashlib.blake2b(digest_size=16)
        acquire = self.auth.acquire
        commit, extend, release = self.auth.commit, self.auth.extend, self.auth.release

        def record(out):  # the same repr from both checkouts' value types
            fields = getattr(out, "__slots__", None)
            value = tuple(getattr(out, f) for f in fields) if fields else out
            self.digest.update(repr(value).encode())
            return out

        self.auth.acquire = lambda req: (record(acquire(req)[0]), [])  # type: ignore[method-assign]
        self.auth.commit = lambda *a: record(commit(*a))  # type: ignore[method-assign]
        self.auth.extend = lambda *a: record(extend(*a))  # type: ignore[method-assign]
        self.auth.release = lambda *a: record(release(*a))  # type: ignore[method-assign]


@dataclass(slots=True)
class _NaiveLease:
    tokens: Sequence[int]
    hashes: list[int]
    table: list[int]
    hashed: int  # leading blocks of `table` whose hash is published


class NaiveEngine:
    """A dict of block hashes (vLLM's prefix caching, simplified): block i of a sequence is
    keyed by hash((key of block i-1, its tokens)); refcounts; unreferenced hashed blocks in an
    LRU OrderedDict, pushed deepest first so tails go before their prefixes. No token checks,
    no namespaces, no partial-block matches, no deferral."""

    def __init__(self, spec: TraceSpec) -> None:
        self.bs = spec.block_size
        n = spec.pool_tokens // spec.block_size
        self.free = list(range(n - 1, -1, -1))
        self.refcount = [0] * n
        self.key_of: dict[int, int] = {}  # block -> its hash, while published
        self.block_of: dict[int, int] = {}  # hash -> block
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.live: dict[int, _NaiveLease] = {}
        self.next_lease = 1
        self.reserve = spec.reserve
        self.evicted = 0

    def _hashes(self, tokens: Sequence[int], start: int, prev: int) -> list[int]:
        bs, out = self.bs, []
        for pos in range(start * bs, len(tokens) - bs + 1, bs):
            prev = hash((prev, tuple(tokens[pos : pos + bs])))
            out.append(prev)
        return out

    def _take(self, n: int) -> list[int]:
        if n > len(self.free) + len(self.lru):
            raise Refused
        while len(self.free) < n:
            b, _ = self.lru.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
            self.free.append(b)
            self.evicted += 1
        out = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        for b in out:
            self.refcount[b] = 1
        return out

    def acquire(self, r: Request) -> tuple[int, int]:
        prompt = r.prompt
        hashes = self._hashes(prompt, 0, 0)
        hits = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            hits.append(b)
        hits = hits[: (len(prompt) - 1) // self.bs]  # one prompt token is always computed
        for b in hits:
            if not self.refcount[b]:
                del self.lru[b]
            self.refcount[b] += 1
        need = -(-(len(prompt) + self.reserve) // self.bs) - len(hits)
        try:
            fresh = self._take(need)
        except Refused:
            self._unref(hits)
            raise
        lease_id, self.next_lease = self.next_lease, self.next_lease + 1
        self.live[lease_id] = _NaiveLease(prompt, hashes, hits + fresh, len(hits))
        return lease_id, len(hits) * self.bs

    def commit(self, lease_id: int, r: Request | Sequence[int]) -> None:
        tokens = r.commit if isinstance(r, Request) else r
        lease = self.live[lease_id]
        nfull = len(tokens) // self.bs
        if nfull > len(lease.hashes):
            prev = lease.hashes[-1] if lease.hashes else 0
            lease.hashes += self._hashes(tokens, len(lease.hashes), prev)
        for i in range(lease.hashed, nfull):
            h, b = lease.hashes[i], lease.table[i]
            if h not in self.block_of and b not in self.key_of:
                self.block_of[h] = b
                self.key_of[b] = h
        lease.hashed = max(lease.hashed, nfull)

    def extend(self, lease_id: int, num_tokens: int) -> None:
        lease = self.live[lease_id]
        lease.table += self._take(max(0, -(-num_tokens // self.bs) - len(lease.table)))

    def release(self, lease_id: int, r: Request) -> None:
        self.commit(lease_id, r.release)
        self._unref(self.live.pop(lease_id).table)

    def _unref(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refcount[b] -= 1
            if self.refcount[b]:
                continue
            if b in self.key_of:
                self.lru[b] = None
            else:
                self.free.append(b)

    def tick(self) -> None:
        pass

    def finish(self) -> dict[str, object]:
        return {"evicted": self.evicted, "indexed": len(self.key_of), "problems": []}


# -- the replay -------------------------------------------------------------------------------


@dataclass
class Replay:
    requests: int = 0
    refused: int = 0
    deferrals: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    times: dict[str, array] = field(default_factory=lambda: {op: array("q") for op in OPS})


@dataclass(slots=True)
class _Live:
    req: Request
    lease: int
    stage: int = 0


def _acquire(engine, reqs: list[Request], out: Replay, deferred: list[Request]) -> list[_Live]:
    granted = []
    times, clock = out.times["acquire"], CLOCK
    for req in reqs:
        t0 = clock()
        try:
            lease, cached = engine.acquire(req)
        except Deferred:
            times.append(clock() - t0)
            out.deferrals += 1
            deferred.append(req)
            continue
        except Refused:
            times.append(clock() - t0)
            out.refused += 1
            continue
        times.append(clock() - t0)
        out.prompt_tokens += len(req.prompt)
        out.cached_tokens += cached
        granted.append(_Live(req, lease))
    return granted


def replay(engine, spec: TraceSpec) -> Replay:
    """Drives `engine` through the trace: acquire at step t, commit at t+1, extend at t+2,
    release at t+3 (about four requests in flight); a Deferral retries at the end of the
    step, after its commits."""
    out = Replay()
    t = out.times
    clock = CLOCK
    live: list[_Live] = []
    deferred: list[Request] = []
    arrivals = trace(spec)
    done = False
    while not done or live or deferred:
        engine.tick()
        # A new request first: it may find its prefix being filled by the one before it.
        fresh: list[_Live] = []
        if not done:
            nxt = next(arrivals, None)
            done = nxt is None
            if nxt is not None:
                fresh = _acquire(engine, [nxt], out, deferred)
        still = []
        for r in live:  # oldest first: commit, extend, release
            t0 = clock()
            if r.stage == 0:
                engine.commit(r.lease, r.req)
                t["commit"].append(clock() - t0)
            elif r.stage == 1:
                try:
                    engine.extend(r.lease, len(r.req.release))
                except Refused:
                    out.refused += 1
                t["extend"].append(clock() - t0)
            else:
                engine.release(r.lease, r.req)
                t["release"].append(clock() - t0)
                out.requests += 1
                continue
            r.stage += 1
            still.append(r)
        # Deferred ones retry once this step's commits are in.
        retry, deferred = deferred, []
        live = still + fresh + _acquire(engine, retry, out, deferred)
    return out


def rss_mib() -> float:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(
    name: str, spec: TraceSpec, profile: str | None, verify: bool = False
) -> dict[str, object]:
    """One replay in this process; what the parent prints."""
    if name == "naive":
        engine: KvserveEngine | NaiveEngine = NaiveEngine(spec)
    else:
        engine = VerifyingEngine(spec) if verify else KvserveEngine(spec)
    before = rss_mib()
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        result = replay(engine, spec)
        prof.disable()
        prof.dump_stats(profile)
    else:
        result = replay(engine, spec)
    after = rss_mib()
    end = engine.finish()
    cost = clock_cost(CLOCK)
    result.times = {op: array("q", (max(0, t - cost) for t in v)) for op, v in result.times.items()}
    total = sum(sum(v) for v in result.times.values())
    row: dict[str, object] = {
        "us/request": total / 1000 / max(1, result.requests),
        "requests": result.requests,
        "refused": result.refused,
        "deferrals": result.deferrals,
        "hit rate": result.cached_tokens / max(1, result.prompt_tokens),
        "evicted": end["evicted"],
        "indexed": end["indexed"],
        "problems": end["problems"],
        "peak RSS MiB": after,
        "RSS growth MiB": after - before,
        "digest": engine.digest.hexdigest() if isinstance(engine, VerifyingEngine) else "",
    }
    for op, times in result.times.items():
        a = np.frombuffer(times, dtype=np.int64) / 1000 if len(times) else np.zeros(1)
        row[f"{op} us"] = float(a.sum() / max(1, result.requests))
        row[f"{op} p50"] = float(np.percentile(a, 50))
        row[f"{op} p99"] = float(np.percentile(a, 99))
    return row


# -- the parent -------------------------------------------------------------------------------


def child(
    engine: str,
    domain: Path,
    spec: TraceSpec,
    profile: str | None = None,
    wall: bool = False,
    verify: bool = False,
) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--domain", str(domain)]
    cmd += ["--wall"] if wall else []
    cmd += ["--verify"] if verify else []
    cmd += ["--spec", json.dumps(asdict(spec))]
    if profile:
        cmd += ["--profile-out", profile]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the {engine} replay of {domain} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


COLUMNS = [
    ("us/request", "{:.1f}"),
    ("acquire p50", "{:.1f}"),
    ("acquire p99", "{:.1f}"),
    ("commit p50", "{:.1f}"),
    ("commit p99", "{:.1f}"),
    ("extend p50", "{:.1f}"),
    ("extend p99", "{:.1f}"),
    ("release p50", "{:.1f}"),
    ("release p99", "{:.1f}"),
    ("hit rate", "{:.3f}"),
    ("evicted", "{:,.0f}"),
    ("deferrals", "{:,.0f}"),
    ("peak RSS MiB", "{:.0f}"),
    ("RSS growth MiB", "{:.0f}"),
]


def print_table(rows: dict[str, dict]) -> None:
    print("| engine | " + " | ".join(c for c, _ in COLUMNS) + " | integrity |")
    print("|---|" + "---|" * (len(COLUMNS) + 1))
    for name, r in rows.items():
        cells = [fmt.format(r[c]) for c, fmt in COLUMNS]
        ok = "clean" if not r["problems"] else f"{len(r['problems'])} problems"
        print(f"| {name} | " + " | ".join(cells) + f" | {ok} |")


def print_profile(path: str, top: int) -> None:
    """The domain's functions by own time, as shares of the domain's time (the cumulative
    time of the authority's four entry points); built-ins count only their calls from the
    domain, the trace generator and the replay loop not at all."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]

    def ours(func: tuple[str, int, str]) -> bool:
        return "kvcache_service" in func[0]

    entries = {"acquire", "commit", "extend", "release"}
    total = sum(
        ct for f, (_, _, _, ct, _) in stats.items() if f[2] in entries and "authority" in f[0]
    )
    rows = []
    for func, (_cc, nc, tt, ct, callers) in stats.items():
        if ours(func):
            rows.append((tt, ct, nc, func))
        elif func[0] == "~":  # a built-in: its calls from the domain
            own = [v for c, v in callers.items() if ours(c)]
            if own:
                rows.append(
                    (sum(v[2] for v in own), sum(v[3] for v in own), sum(v[1] for v in own), func)
                )
    rows.sort(key=lambda r: -r[0])
    print(f"\n# cProfile: {total:.2f} s in the domain (profiled, so slower than the table)")
    print("| function | calls | own time | with callees |")
    print("|---|---|---|---|")
    for tt, ct, nc, (file, line, fn) in rows[:top]:
        where = f"{Path(file).name}:{line} {fn}" if line else fn
        print(f"| {where} | {nc:,} | {tt / total:.1%} | {ct / total:.1%} |")
    print("\n| where the domain's time goes (with callees) | share |")
    print("|---|---|")
    for category, funcs in CATEGORIES.items():
        t = sum(
            ct
            for f, (_, _, _, ct, _) in stats.items()
            if ours(f) and (Path(f[0]).stem, f[2]) in funcs
        )
        print(f"| {category} | {t / total:.1%} |")


# The domain's work grouped for `--profile`, by (module, function) of this checkout and of
# HEAD before issue 12; no function listed calls another, so the shares add up.
CATEGORIES = {
    "token ids checked (and packed)": {("authority", "as_tokens"), ("tokens", "pack")},
    "index: match (acquire)": {("radix_index", "match")},
    "index: insert (commit, release)": {("radix_index", "insert")},
    "eviction": {("budget", "evict"), ("budget", "_evict_oldest")},
    "references taken (acquire, adoption)": {("lease_book", "_ref"), ("budget", "ref_all")},
    "references dropped (release)": {("lease_book", "_end")},
    "in-flight chain hashes": {
        ("inflight", "chain_hashes"),
        ("inflight", "register"),
        ("inflight", "committed"),
    },
    "nodes marked used": {("radix_index", "touch")},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = TraceSpec()
    p.add_argument("--quick", action="store_true", help="5k requests: under a minute")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--systems", type=int, default=d.systems)
    p.add_argument("--system-tokens", type=int, nargs=2, default=d.system_tokens)
    p.add_argument("--zipf", type=float, default=d.zipf)
    p.add_argument("--follow-up", type=float, default=d.follow_up)
    p.add_argument("--open", type=int, default=d.open)
    p.add_argument("--user-tokens", type=int, nargs=2, default=d.user_tokens)
    p.add_argument("--generated", type=int, nargs=2, default=d.generated)
    p.add_argument("--max-context", type=int, default=d.max_context)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--pool-tokens", type=int, default=d.pool_tokens)
    p.add_argument("--reserve", type=int, default=d.reserve)
    p.add_argument(
        "--inputs",
        choices=["servicer", "lists"],
        default=d.inputs,
        help="token ids as the gRPC servicer passes them, or as Python lists",
    )
    p.add_argument("--baseline", type=Path, help="another checkout to replay side by side")
    p.add_argument("--naive", action="store_true", help="add the dict-of-hashes reference row")
    p.add_argument("--repeat", type=int, default=1, help="rounds, engines alternating; medians")
    p.add_argument("--profile", action="store_true", help="cProfile a replay (and the baseline's)")
    p.add_argument("--wall", action="store_true", help="time wall clock, not thread CPU time")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also check that this checkout answers every call as the baseline does",
    )
    p.add_argument("--top", type=int, default=25, help="profile rows to print")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--domain", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.child:
        global CLOCK
        CLOCK = time.perf_counter_ns if a.wall else time.thread_time_ns
        sys.path.insert(0, str(a.domain))
        raw = json.loads(a.spec)
        spec = TraceSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        print(json.dumps(run_engine(a.child, spec, a.profile_out, a.verify)))
        return

    if a.quick:
        a.requests = min(a.requests, 5000)
    spec = TraceSpec(
        a.seed,
        a.requests,
        a.systems,
        tuple(a.system_tokens),
        a.zipf,
        a.follow_up,
        a.open,
        tuple(a.user_tokens),
        tuple(a.generated),
        a.max_context,
        a.block_size,
        a.pool_tokens,
        a.reserve,
        a.inputs,
    )
    print(
        f"# {spec.requests:,} requests (seed {spec.seed}): {spec.systems} system prompts of "
        f"{spec.system_tokens[0]}-{spec.system_tokens[1]} tokens (Zipf {spec.zipf}), "
        f"{spec.follow_up:.0%} follow-ups, pool {spec.pool_tokens:,} tokens in blocks of "
        f"{spec.block_size}; {spec.inputs} inputs; {'wall' if a.wall else 'thread CPU'} time in us\n"
    )
    engines = {"kvserve": ("kvserve", ROOT)}
    if a.baseline:
        engines = {"baseline": ("kvserve", a.baseline.resolve()), **engines}
    if a.profile:
        for name, (engine, domain) in engines.items():
            out = f"/tmp/bench_trace.{name}.prof"
            print(f"\n## {name} ({domain})\n")
            print_table({f"{name} (profiled)": child(engine, domain, spec, out, a.wall)})
            print_profile(out, a.top)
        return
    if a.verify and a.baseline:
        digests = {n: child(*engines[n], spec, verify=True)["digest"] for n in engines}
        same = "identical" if len(set(digests.values())) == 1 else "DIFFERENT"
        print(f"answers to every call, digested (blake2b): {digests} -> {same}\n")
    if a.naive:
        engines["naive dict of hashes"] = ("naive", ROOT)
    # Rounds, the engines' order alternating; each column is the median over rounds, and a
    # ratio the median of the rounds' ratios (a machine that slows down for a while then
    # weighs on both sides of one round, not on one engine).
    rounds: list[dict[str, dict]] = []
    for k in range(a.repeat):
        names = list(engines) if k % 2 == 0 else list(reversed(engines))
        rounds.append({n: child(*engines[n], spec, wall=a.wall) for n in names})
    table = {n: median_row([r[n] for r in rounds]) for n in engines}
    print_table(table)
    if a.repeat > 1:
        per_round = [f"{r['kvserve']['us/request']:.0f}" for r in rounds]
        print(f"\nkvserve us/request by round: {', '.join(per_round)}")
    if "baseline" in table:
        base, new = table["baseline"], table["kvserve"]

        def ratio(col: str) -> float:
            return statistics.median(r["kvserve"][col] / r["baseline"][col] for r in rounds)

        print(
            f"\nkvserve / baseline, domain time per request: {ratio('us/request'):.3f} "
            f"({1 / ratio('us/request'):.2f}x faster; median of {a.repeat} rounds); hit rate "
            f"{base['hit rate']:.3f} -> {new['hit rate']:.3f}"
        )
        for op in OPS:
            print(f"  {op}: {ratio(op + ' us'):.3f} of baseline")


def median_row(rows: list[dict]) -> dict:
    """Each numeric column's median over `rows`; the rest from the first."""
    out = dict(rows[0])
    for col, v in rows[0].items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[col] = statistics.median(r[col] for r in rows)
    out["problems"] = [p for r in rows for p in r["problems"]]
    return out


if __name__ == "__main__":
    main()
