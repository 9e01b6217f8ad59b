"""The kvserve worker: an mlx-lm model running on a paged KV pool whose blocks a central
cache service leases out.

Owns: the engine (step loop, scheduler, sequences, lease traffic with the cache service), the
model path (KV pool, paged cache, forward batch, block attention, runners), weight loading
(``model_loader``) and the worker's gRPC edge.

May import: ``kvserve_model`` (model name, tokenizer files, context length, BLAS, sampling
limits), ``kvserve_launch``'s startup and TLS helpers, ``kvserve_proto`` (at its edges: the
servicer, the lease client), ``mlx`` and ``mlx_lm``. Never ``gateway`` or ``kvcache_service``:
it reaches the cache service over gRPC. Inside, each layer imports only those below it: the
model path (``worker/model``) nothing of the engine, the engine (``worker/engine``) nothing of
the edge (servicer, lease client) or the assembly (config, server, model setup, warm-up), which
turns config into the plain values they take; ``worker/engine/scheduler.py`` loads no MLX and no
RPC (docs/architecture.md, "Import rules"; tests/test_import_rules.py).
"""
