"""The model path of the worker: an unmodified mlx-lm model run against a paged KV pool.

``loader`` (weights, fingerprint), ``spec`` (what the model's layers need, and what it refuses),
``kv_pool`` (the physical blocks), ``paged_cache`` (mlx-lm's cache protocol over the pool),
``forward_batch`` (one batched forward's metadata), ``attention`` (attention over the pool's
block tables: one backend a device, chosen at start), ``runner`` (paged) and ``dense_runner`` (recurrent models), ``sampling`` (per-row sampling on
the MLX thread; its results, plain values, in ``sampled``) and ``self_check`` (the startup
parity check).

May import: ``worker.errors``, ``worker.ids``, ``kvserve_model``, MLX and mlx-lm. Never
``worker.engine`` (the engine imports the model path, not the other way: the sampling values
both use live here, in ``sampled``), the worker's edge and assembly (``worker.config``,
``worker.device_defaults``, ``worker.server``, ``worker.servicer``, ``worker.warmup``: callers
turn config into plain values), gRPC or protos (tests/test_import_rules.py).
"""
