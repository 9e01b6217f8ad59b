"""One layer's view of a forward batch over the pool, speaking mlx-lm's cache protocol.

Unmodified mlx-lm models call, per attention layer, ``rope(x, offset=cache.offset)``, then
``keys, values = cache.update_and_fetch(k, v)`` and attend over what comes back; once per forward
they build the mask with ``cache.make_mask(N, return_array=..., window_size=...)``. This object
answers those calls from the shared :class:`ForwardBatch` and the pool: it writes the new K/V at
their slots and returns each sequence's whole blocks gathered into ``[B, heads, L, dim]``.

It must not have an attribute named ``bits``: mlx-lm takes that as a quantized cache.
A view lives for one forward only; it holds no state of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from worker.errors import BatchError
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_pool import KVPool

if TYPE_CHECKING:
    from worker.model.attention.backend import AttentionBackend


class PagedLayerCache:
    """mlx-lm cache protocol for layer ``layer`` of ``pool`` during one forward of ``batch``,
    whose attention ``backend`` serves (``worker.model.attention``)."""

    __slots__ = ("_batch", "_fetched", "_layer", "_pool", "backend")

    def __init__(
        self, batch: ForwardBatch, pool: KVPool, layer: int, backend: AttentionBackend
    ) -> None:
        self._batch = batch
        self._pool = pool
        self._layer = layer
        self.backend = backend
        self._fetched: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> int | mx.array:
        """Positions already in the pool: an int if all sequences agree, else ``[B]``."""
        return self._batch.offset

    @property
    def batch(self) -> ForwardBatch:
        return self._batch

    @property
    def pool(self) -> KVPool:
        return self._pool

    @property
    def layer(self) -> int:
        return self._layer

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``[B, heads, N, dim]`` at this forward's slots; return the context, gathered.

        The gather is lazy: when the backend reads the pool by block table it is never
        evaluated. In a forward with stand-ins (``ForwardBatch.stand_ins``) the new K/V come
        back in place of the context, and the backend gathers it if it has to
        (``AttentionCall.context``).
        """
        batch = self._batch
        self._pool.write(self._layer, batch.write_blocks, batch.write_slots, keys, values)
        self._fetched = (keys, values) if batch.stand_ins else self.gather()
        return self._fetched

    def gather(self) -> tuple[mx.array, mx.array]:
        """Each sequence's whole blocks ``[B, heads, L, dim]`` (lazy), as the backend reads
        them."""
        return self.backend.gather(self._pool, self._layer, self._batch.tables)

    def fetched(self) -> tuple[mx.array, mx.array] | None:
        """What :meth:`update_and_fetch` returned in this forward, if it was called."""
        return self._fetched

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The batch's mask for ``n`` queries (mlx-lm passes ``n`` positionally)."""
        if self._batch.query_len != n:
            raise ValueError(f"mask asked for {n} queries in a batch of {self._batch.query_len}")
        return self._batch.mask(window_size, return_array)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    def size(self) -> int:
        if self._batch.traced:  # the traced step's value would hold for every later step
            raise BatchError("cache.size() is not traceable: this forward is not compiled")
        return int(self._batch.ends.max())

    @property
    def nbytes(self) -> int:
        k, v = self._pool.layer_arrays(self._layer)
        return k.nbytes + v.nbytes
