"""The attention backend protocol: what the paged path asks of a device's attention.

Every attention layer of an unmodified mlx-lm model writes its new K/V through
``cache.update_and_fetch`` and then calls ``scaled_dot_product_attention``; on the paged path
that call arrives here (``attention.seam``) as an :class:`AttentionCall` and goes to the one
:class:`AttentionBackend` the worker chose at start (``attention.choose_backend``). A backend
serves a call with a decode path (up to :data:`FEW_QUERIES` queries a sequence: a decode, or
one with its speculative drafts) or a prefill path, or declines it with a reason
(:class:`Declined`); a declined call takes the reference path, gather-then-SDPA
(:func:`reference_attention`), which is mlx-lm's own computation over the gathered context and
what every backend is tested against.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models import base

if TYPE_CHECKING:
    import mlx.nn as nn

    from worker.model.forward_batch import ForwardBatch
    from worker.model.kv_pool import KVPool
    from worker.model.paged_cache import PagedLayerCache

ORIGINAL_SDPA = base.scaled_dot_product_attention
"""mlx-lm's attention function, before ``attention.seam.install`` routes a model past it."""

# Queries a sequence up to which attention reads the pool blocks like a decode (one query) does:
# a speculative decode verifies its last token and up to 16 drafts. Longer chunks are prefill.
# (Batch 8 of a 110M llama at context 400: 2 queries a sequence took 222 ms through the prefill
# path, which gathers every context whole and syncs each layer for numpy, against 103 ms for 1.)
FEW_QUERIES = 17


@dataclass(frozen=True, slots=True)
class Declined:
    """A backend's answer to a call it does not serve; the reason is counted per backend
    (:attr:`AttentionBackend.declined`) and the call takes the reference path."""

    reason: str


@dataclass(slots=True)
class AttentionCall:
    """One layer's attention call on the paged path, as mlx-lm made it."""

    queries: mx.array  # [B, Hq, N, D]
    keys: mx.array  # what the model passed: the fetched context, or stand-ins (see context())
    values: mx.array
    cache: PagedLayerCache
    scale: float
    mask: Any  # None, "causal" or an array
    sinks: mx.array | None = None

    @property
    def batch(self) -> ForwardBatch:
        return self.cache.batch

    @property
    def queries_per_seq(self) -> int:
        return int(self.queries.shape[2])

    def pool_arrays(self) -> tuple[mx.array, mx.array]:
        """This layer's pool ``[H, blocks, block_size, D]``, K and V."""
        return self.cache.pool.layer_arrays(self.cache.layer)

    def over_fetched(self) -> bool:
        """Whether the call computes the batch's queries over exactly the K/V its cache fetched
        (else the model changed the keys after fetching them: attention must use what it
        passes)."""
        fetched = self.cache.fetched()
        return (
            fetched is not None
            and self.keys is fetched[0]
            and self.values is fetched[1]
            and self.batch.query_len == self.queries_per_seq
        )

    def reads_pool(self) -> bool:
        """Whether this call is a decode, or a decode with drafts (at most FEW_QUERIES queries a
        sequence), over exactly the K/V its cache fetched, with a mask that attention from the
        pool blocks can apply."""
        n, mask, batch = self.queries_per_seq, self.mask, self.batch
        if not 1 <= n <= FEW_QUERIES or not self.over_fetched():
            return False
        if mask is None or isinstance(mask, str):
            return mask in (None, "causal")
        return (
            mask.ndim == 4
            and mask.shape[1:] == (1, n, batch.key_len)
            and len(mask) in (1, batch.size)
        )

    def kernel_window(self) -> tuple[bool, int | None]:
        """Whether a kernel that computes masks from positions reproduces the mask exactly, and
        with which sliding window: no mask for one query, ``"causal"`` (the batch's keys are
        each sequence's context), or an array this batch built (``ForwardBatch.mask``)."""
        mask = self.mask
        if mask is None:
            return self.queries_per_seq == 1, None
        if isinstance(mask, str):
            return mask == "causal", None
        return self.batch.mask_window(mask)

    def context(self) -> tuple[mx.array, mx.array]:
        """The K/V to attend over: what the model passed, or, where those are the stand-ins the
        cache handed back (``ForwardBatch.stand_ins``), the gathered context they stand for."""
        if self.batch.stand_ins and self.over_fetched():
            return self.cache.gather()
        return self.keys, self.values


def reference_attention(call: AttentionCall) -> mx.array:
    """Gather-then-SDPA: mlx-lm's own attention over each sequence's gathered context."""
    keys, values = call.context()
    return ORIGINAL_SDPA(
        call.queries,
        keys,
        values,
        cache=call.cache,
        scale=call.scale,
        mask=call.mask,
        sinks=call.sinks,
    )


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """Which decode path a backend takes, and what it measured to choose it (CPU)."""

    path: str  # the CPU's "blocks", "gather" or "kernel"; elsewhere the backend's name
    blocks_s: float = 0.0
    gather_s: float = 0.0
    kernel_s: float = 0.0  # 0: the compiled kernel was not a candidate
    kernel_threads: int = 0
    """Threads the kernel measured ``kernel_s`` on (and runs on, where it is the path)."""
    kernel_other_s: float = 0.0
    """The kernel on its other thread count (one, or every core): 0 where not measured."""
    pool_path: str = ""
    """The CPU's faster MLX path, ``"blocks"`` or ``"gather"``: what a decode the kernel does
    not serve takes ("" elsewhere)."""

    def describe(self) -> str:
        if not self.blocks_s:
            return f"decode attention: {self.path}"
        kernel = ""
        if self.kernel_s:
            kernel = f", compiled kernel {self.kernel_s * 1e3:.1f} ms on {self.kernel_threads}"
            kernel += " thread" if self.kernel_threads == 1 else " threads"
        if self.kernel_other_s:
            kernel += f" ({self.kernel_other_s * 1e3:.1f} ms on the other count)"
        path = self.path
        if path == "kernel":
            path += f" on {self.kernel_threads} thread" + ("s" if self.kernel_threads > 1 else "")
        return (
            f"decode attention: {path} (one layer's projections and attention at a batch-32 "
            f"decode: blocks {self.blocks_s * 1e3:.1f} ms, gather + SDPA "
            f"{self.gather_s * 1e3:.1f} ms{kernel})"
        )


class AttentionBackend:
    """Attention over the paged pool on one device. This base is the reference backend:
    every call takes gather-then-SDPA. A device's backend overrides :meth:`decode` and
    :meth:`prefill` (return the output, or :class:`Declined`) and what else it needs."""

    name = "reference"
    stand_ins = False
    """Whether decode forwards may skip gathering the context in ``update_and_fetch`` (the
    new K/V stand in for it): for a backend whose decodes read the pool by block table, where
    the gather would never run but building it per layer costs host time. The runner checks
    once at start that the model hands the fetched K/V to attention unchanged."""
    compiles_decodes = False
    """Whether decode forwards may run compiled (``worker.model.compiled_decode``): every
    decode call traceable (the GPU kernel; not the CPU's numpy or numba paths)."""

    def __init__(self) -> None:
        self.declined: Counter[str] = Counter()
        """Calls declined, by reason (each took the reference path)."""

    def attend(self, call: AttentionCall) -> mx.array:
        """The one entry point (``attention.seam.paged_sdpa``): decode or prefill, else the
        reference path."""
        if call.sinks is not None:
            out: mx.array | Declined = Declined("attention sinks")
        elif call.queries_per_seq <= FEW_QUERIES:
            out = self.decode(call)
        else:
            out = self.prefill(call)
        if isinstance(out, Declined):
            self.declined[out.reason] += 1
            return reference_attention(call)
        return out

    def decode(self, call: AttentionCall) -> mx.array | Declined:
        """A call of at most :data:`FEW_QUERIES` queries a sequence."""
        return Declined("the reference backend")

    def prefill(self, call: AttentionCall) -> mx.array | Declined:
        """A call of more queries a sequence (a prefill chunk)."""
        return Declined("the reference backend")

    def gather(self, pool: KVPool, layer: int, tables: mx.array) -> tuple[mx.array, mx.array]:
        """Each sequence's whole blocks ``[B, heads, L, dim]`` of ``layer`` (lazy)."""
        return pool.gather(layer, tables)

    def prepare(self, model: nn.Module, pool: KVPool) -> None:
        """Called once by the runner, on the thread that will run its forwards."""

    def choose_decode(
        self, model: nn.Module, pool: KVPool, batch: int = 32, context: int = 1024, repeats: int = 7
    ) -> DecodeChoice:
        """Measure, where there is a choice, which decode path is fastest here at a decode of
        ``batch`` sequences of ``context`` tokens (``repeats`` timings each); keep it."""
        return DecodeChoice(self.name)

    def describe(self) -> str:
        return f"attention: {self.name}"
