"""The worker's one config object: flags, with KVWORKER_* environment defaults."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve_launch.common_flags import LOG_LEVEL_HELP, ServerClientFlags, tls_help
from kvserve_launch.settings import Flag, Settings
from kvserve_launch.tls import check_server
from kvserve_model.default_model import DEFAULT_MODEL_NAME
from kvserve_model.sampling_limits import MAX_DRAFT_TOKENS

ENV_PREFIX = "KVWORKER_"
DEQUANTIZE = ("auto", "always", "never")
TIER_LOAD = ("auto", "always", "never")
# worker.engine.lookahead.MODES: the engine imports nothing of the assembly, so it is said twice
# (tests/worker_engine/test_lookahead_policy.py holds them equal).
LOOKAHEAD_MODES = ("auto", "on", "off")
# worker.model.attention.BACKENDS (not imported: this module loads before MLX may).
ATTENTION = ("auto", "reference", "cpu", "cuda", "metal")
GROUP_BACKENDS = ("any", "ring", "nccl", "mpi", "jaccl")


@dataclass(frozen=True, slots=True)
class WorkerConfig(ServerClientFlags):
    cache_service: str = "127.0.0.1:50051"
    # The cache service's service token (sent as a bearer token); empty: its auth is off.
    cache_token: str = ""
    host: str = "127.0.0.1"
    port: int = 50061
    # Address the gateway should dial; empty: host:port as bound.
    advertise_address: str = ""
    # Pool id at the cache service; empty: "<hostname>-<port>".
    worker_id: str = ""
    model: str = DEFAULT_MODEL_NAME
    block_size: int = 32
    # Pool size, the first one set of: a block count, a memory budget, a fraction of the device
    # memory free after the weights load. 0 everywhere: the device's default
    # (worker.device_defaults: 256 MiB on CPU, half the free memory on a GPU).
    num_blocks: int = 0
    kv_memory_mb: int = 0
    kv_memory_fraction: float = 0.0
    # Continuous batching: sequences per step, and tokens per step (decodes + prefill chunks).
    # 0: the device's default (CPU 16 and 256, GPU 32 and 2048).
    max_batch_size: int = 0
    max_step_tokens: int = 0
    # Beside decodes, a step may take this many times a decode-only step: prefill chunks shrink
    # so that every decoding stream gets its next token within it (worker.engine.step_budget).
    # 0 (the default): no latency cap, prefill chunks up to --max-step-tokens whatever decodes
    # wait; the cap costs time to first token, on a CPU 3-4x.
    itl_ratio: float = 0.0
    # Most requests held at once, running + waiting; beyond it Generate is RESOURCE_EXHAUSTED
    # and the gateway tries another worker. None: PENDING_PER_BATCH_SLOT x max_batch_size
    # (worker.device_defaults); 0: no limit.
    max_pending_requests: int | None = None
    # The longest a request waits for room in the KV pool (blocks held by running requests,
    # pinned prefixes, a namespace quota) before it ends with RESOURCE_EXHAUSTED; 0: no limit.
    # One the pool could never hold is refused at once (INVALID_ARGUMENT).
    admission_timeout_s: float = 120.0
    # The cache service unreachable this long: requests waiting for a lease or a block end
    # (ABORTED: the gateway answers 503), and new ones are refused until it is back; running
    # requests go on while their blocks last. 0: wait it out.
    cache_outage_timeout_s: float = 30.0
    # Token slots leased beyond the prompt at admission, and how far ahead of need a running
    # sequence asks for its next block.
    reserve_tokens: int = 32
    extend_ahead_tokens: int = 8
    # Off: every request computes its whole prompt (benchmarks, debugging).
    prefix_caching: bool = True
    # The disk tier (docs/kv-tiers.md): every committed block is also written here, so blocks
    # the pool evicts, and everything after a restart, load back instead of being computed.
    # Empty: no disk tier. Its size in GB; 0: half the free space of its file system at start.
    offload_dir: str = ""
    offload_gb: float = 0.0
    # The host-memory tier in GB, in front of the disk tier, where the device has memory of
    # its own (CUDA; ignored elsewhere, where the pool already is host memory). 0: none.
    host_offload_gb: float = 0.0
    # Whether a grant's tier blocks load: "auto" when loading measures faster than computing
    # (worker.tier.speed), "always", or "never" (the tier is kept, every prompt computes).
    tier_load: str = "auto"
    # Speculative decoding (a request opts in): a small model with the same tokenizer for
    # "draft_model" speculation (empty: none; "ngram" needs none), and the drafts per step
    # for requests that name no number.
    draft_model: str = ""
    num_draft_tokens: int = 4
    # Tokens a Generate stream message carries at least (the first goes alone, at once): more
    # streams fewer, larger messages, for throughput where a message costs more than a token.
    stream_interval: int = 1
    # Decode lookahead (worker.engine.lookahead): start the next greedy decode step's forward
    # on the sampled tokens before they reach the event loop. "auto" (the default) takes it
    # on a GPU while the steps' device time past their launches says it pays (on an H200 it
    # won 1.20-1.24x at 32 x 8k-token contexts and lost 5-7% at 96-token prompts: a 1B
    # model, docs/worker-engine.md "Decode lookahead"), and never on a CPU, where the forward
    # is the step; "on" or "off" fix it.
    decode_lookahead: str = "auto"
    # Run the engine's shapes once before registering, so no request pays for first-use
    # kernel compilation and allocation (worker.warmup).
    warmup: bool = True
    # Quantized weights on a CPU (worker.model.loader): "auto" dequantizes them to float32
    # where that fits a quarter of the memory (MLX's CPU quantized matmul has no BLAS: the
    # default model prefilled 30x slower quantized); "always" or "never".
    dequantize: str = "auto"
    # Check the paged path against mlx-lm's dense path on a small batch at startup and refuse a
    # model whose logits differ (worker.model.self_check).
    self_check: bool = True
    # Attention over the pool (worker.model.attention): the backend, chosen once at start.
    # "auto": cpu on a CPU, cuda on an NVIDIA GPU, reference (gather-then-SDPA) on an Apple
    # GPU; "metal" (the decode kernel's untested Metal twin) only when asked.
    attention: str = "auto"
    # cpu: MLX streams a decode's attention is split over (0: one per core, at most 8), and
    # whether the compiled decode kernel may be measured and taken at start.
    attention_streams: int = 0
    cpu_decode_kernel: bool = True
    # cuda: prefill chunks through the block-table prefill kernel (off: gather then cuDNN),
    # decode forwards compiled (worker.model.compiled_decode), the self-check's kernels built
    # in a child process at start (worker.precompile), and MLX's sorted expert gathers kept
    # (off: routed to the unsorted kernels, worker.model.mlx_fixes).
    prefill_kernel: bool = True
    compile_decodes: bool = True
    precompile: bool = True
    cuda_sorted_gather: bool = False
    # Tensor parallel (docs/tensor-parallel.md): the model sharded over this many ranks on this
    # machine (mlx-lm's shard(); one pool, each rank holding its KV heads' slice), rank 0 this
    # process, the others started by it; 1: one process. The backend of mx.distributed: "any"
    # (NCCL on NVIDIA GPUs, else the ring over loopback TCP), or one by name.
    tensor_parallel: int = 1
    group_backend: str = "any"
    group_timeout_s: float = 300.0
    # A group whose ranks start on their own (several machines; a pod a rank): every rank's
    # "host:port" in rank order ("{ordinal}" stands for the number ending this host's name, a
    # StatefulSet pod's ordinal), and this process's rank. Empty: rank 0 starts the others here.
    group_hosts: str = ""
    group_rank: int = 0
    # TLS and log_level: ServerClientFlags. The gRPC port serves TLS with tls_cert/tls_key; the
    # same pair is the worker's client certificate when it dials the cache service over TLS
    # (verified against tls_ca).

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> WorkerConfig:
        return SETTINGS.parse(argv, check)

    def pool_id(self, bound_port: int) -> str:
        return self.worker_id or f"{socket.gethostname()}-{bound_port}"

    def address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"


def check(c: WorkerConfig) -> str | None:
    """What is wrong across the fields of ``c``; None if nothing."""
    if problem := check_server(c.tls_cert, c.tls_key, c.tls_client_ca):
        return problem
    if c.block_size < 1:
        return "--block-size must be positive"
    for name in ("num_blocks", "kv_memory_mb", "max_batch_size", "max_step_tokens"):
        if getattr(c, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0 (0: the device's default)"
    if c.itl_ratio != 0 and c.itl_ratio <= 1:
        return "--itl-ratio must be above 1 (a step's time in decode steps) or 0 (no cap)"
    if c.max_pending_requests is not None and c.max_pending_requests < 0:
        return "--max-pending-requests must be >= 0 (0: no limit)"
    if c.admission_timeout_s < 0 or c.cache_outage_timeout_s < 0:
        return "--admission-timeout-s and --cache-outage-timeout-s must be >= 0 (0: no limit)"
    if c.stream_interval < 1:
        return "--stream-interval must be >= 1"
    if not 1 <= c.num_draft_tokens <= MAX_DRAFT_TOKENS:
        return f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}]"
    if c.attention not in ATTENTION:
        return f"--attention must be one of {', '.join(ATTENTION)}"
    if c.attention_streams < 0:
        return "--attention-streams must be >= 0 (0: one per core)"
    if c.dequantize not in DEQUANTIZE:
        return f"--dequantize must be one of {', '.join(DEQUANTIZE)}"
    if not 0.0 <= c.kv_memory_fraction <= 1.0:
        return "--kv-memory-fraction must be in [0, 1] (0: the device's default)"
    if c.offload_gb < 0 or c.host_offload_gb < 0:
        return "--offload-gb and --host-offload-gb must be >= 0"
    if c.decode_lookahead not in LOOKAHEAD_MODES:
        return f"--decode-lookahead must be one of {', '.join(LOOKAHEAD_MODES)}"
    if c.tier_load not in TIER_LOAD:
        return f"--tier-load must be one of {', '.join(TIER_LOAD)}"
    if c.tensor_parallel < 1:
        return "--tensor-parallel must be >= 1"
    if c.group_timeout_s < 0:
        return "--group-timeout-s must be >= 0 (0: never)"
    if c.group_backend not in GROUP_BACKENDS:
        return f"--group-backend must be one of {', '.join(GROUP_BACKENDS)}"
    if c.group_hosts:
        hosts = c.group_hosts.split(",")
        if len(hosts) != c.tensor_parallel or c.tensor_parallel < 2:
            return (
                f"--group-hosts names {len(hosts)} ranks; --tensor-parallel is "
                f"{c.tensor_parallel} (they must agree, and be 2 or more)"
            )
        if any(h.rpartition(":")[1] != ":" or not h.rpartition(":")[2].isdigit() for h in hosts):
            return f"--group-hosts must be host:port entries separated by commas: {c.group_hosts}"
        if not 0 <= c.group_rank < len(hosts):
            return f"--group-rank must be in 0..{len(hosts) - 1}, got {c.group_rank}"
    elif c.group_rank:
        return "--group-rank needs --group-hosts (the ranks' addresses)"
    if c.offload_gb and not c.offload_dir:
        return "--offload-gb needs --offload-dir (where the disk tier's files go)"
    return None


SETTINGS = Settings(
    WorkerConfig,
    ENV_PREFIX,
    prog="python -m worker",
    description="An MLX compute worker (gRPC). Every flag also reads KVWORKER_<FLAG>.",
    flags={
        "cache_service": "the cache service's address",
        "cache_token": Flag("the cache service's service token, sent on every call", secret=True),
        "host": "listen address",
        "port": "gRPC port (0: any free port)",
        "advertise_address": "the address gateways dial (default: host:port)",
        "worker_id": "the pool id at the cache service (default: hostname-port)",
        "model": "the default model, an mlx-lm directory, a .gguf file or a Hugging Face id",
        "block_size": "tokens per KV block",
        "num_blocks": "pool size in blocks (0: from the next two, else the device's default)",
        "kv_memory_mb": "pool size as a memory budget in MiB",
        "kv_memory_fraction": "pool size as a fraction of the memory free after the weights",
        "max_batch_size": "sequences per engine step (0: 32)",
        "max_step_tokens": "tokens per step (0: 256 on CPU, 2048 on a GPU)",
        "itl_ratio": "beside decodes, a step takes at most this many decode-only steps: "
        "prefill chunks shrink to fit (0: no cap, the default)",
        "max_pending_requests": "most requests held, running + waiting (default: 8 x batch; "
        "0: no limit)",
        "admission_timeout_s": (
            "the longest a request waits for room in the pool while no lease comes back "
            "(0: no limit)"
        ),
        "cache_outage_timeout_s": "the cache service unreachable this long: waiting requests "
        "end, new ones are refused (0: wait it out)",
        "reserve_tokens": "token slots leased beyond the prompt at admission",
        "extend_ahead_tokens": "how far ahead of need a sequence asks for its next block",
        "prefix_caching": Flag(
            "compute every prompt in full (benchmarks, debugging)", off_only=True
        ),
        "offload_dir": "the disk tier: a directory every committed KV block is also written "
        "to; evicted blocks and prefixes from before a restart load back from it",
        "offload_gb": "the disk tier's size in GB (0: half the free space of its file system)",
        "tier_load": "a grant's tier blocks load: auto (when measured faster than computing), "
        "always or never",
        "host_offload_gb": "a host-memory tier of this many GB in front of the disk tier "
        "(GPUs with memory of their own; 0: none)",
        "draft_model": "a small model with the same tokenizer, for requests that ask for "
        "speculative draft_model",
        "num_draft_tokens": "speculative decoding: drafts per step when a request names none",
        "stream_interval": "tokens a stream message carries at least, after the first",
        "warmup": "run the engine's shapes once before saying ready",
        "decode_lookahead": "start the next greedy decode step before streaming this one: auto "
        "(on a GPU, while measured to pay), on or off",
        "dequantize": "quantized weights to float32: auto (on a CPU, where they fit a quarter of "
        "memory), always or never",
        "self_check": "refuse a model whose paged path disagrees with mlx-lm's dense path",
        "attention": "attention backend: auto, reference (gather-then-SDPA), cpu, cuda or metal "
        "(untested)",
        "attention_streams": "cpu: MLX streams decode attention is split over (0: one per core)",
        "cpu_decode_kernel": Flag(
            "cpu: keep the compiled decode kernel out of the start-up choice", off_only=True
        ),
        "prefill_kernel": Flag("cuda: prefill through gather then cuDNN only", off_only=True),
        "compile_decodes": Flag("cuda: run decode forwards uncompiled", off_only=True),
        "precompile": Flag(
            "cuda: build the self-check's kernels in the worker, not in a child", off_only=True
        ),
        "cuda_sorted_gather": "cuda: keep MLX's sorted expert gathers (an MLX that fixed them)",
        "tensor_parallel": "shard the model over this many ranks on this machine (one pool; "
        "rank 0 is this process, it starts the others)",
        "group_backend": "mx.distributed backend of a worker group: any, ring, nccl, mpi or jaccl",
        "group_timeout_s": "a worker group's longest step (or warm-up call) before rank 0 exits "
        "1 for the group to restart: a rank that stopped answering stalls every collective "
        "(0: never)",
        "group_hosts": "ranks that start on their own (several machines): every rank's host:port "
        "in rank order, comma-separated ({ordinal}: the number ending this host's name)",
        "group_rank": "with --group-hosts: this process's rank (0 serves, the others follow)",
        **tls_help(
            cert="PEM certificate: with --tls-key, the gRPC port serves TLS",
            ca="PEM CA bundle: reach the cache service over TLS, verified against it",
            server_name="the name the cache service's certificate must carry",
            client_ca="PEM CA bundle: callers must present a certificate it signed",
        ),
        "log_level": LOG_LEVEL_HELP,
    },
)
