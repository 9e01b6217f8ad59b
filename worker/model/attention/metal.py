"""The Apple GPU's block-table decode backend, opt-in: **untested on hardware**.

It runs the CUDA decode kernel's Metal twin (``paged_decode.cu``'s template rendered with
``paged_decode.metal``'s header through ``mx.fast.metal_kernel``; ``attention.gpu_decode``):
the same algorithm, but it has never run, since no Apple GPU was at hand. An Apple GPU
therefore takes the reference backend unless a worker asks for this one (``--attention
metal``); prefill chunks always take the reference path (a ``simdgroup_matrix`` prefill kernel
is not written). Whoever runs it first: check it with ``tests/worker/test_gpu_attention.py``.
"""

from __future__ import annotations

import mlx.core as mx

from worker.model.attention import gpu_decode
from worker.model.attention.backend import AttentionBackend, AttentionCall, Declined


class MetalBackend(AttentionBackend):
    name = "metal"

    def decode(self, call: AttentionCall) -> mx.array | Declined:
        return gpu_decode.serve(call, backend="metal")

    def describe(self) -> str:
        return "attention: metal (decodes: block-table kernel, untested on hardware)"
