"""The model path of the worker: an unmodified mlx-lm model run against a paged KV pool.

``loader`` (weights, fingerprint), ``spec`` (what the model's layers need, and what it refuses),
``kv_pool`` (the physical blocks), ``paged_cache`` (mlx-lm's cache protocol over the pool),
``forward_batch`` / ``block_attention`` (batched forwards and attention over block tables),
``runner`` (paged) and ``dense_runner`` (recurrent models), ``sampling`` (per-row sampling on
the MLX thread) and ``self_check`` (the startup parity check).

May import: ``worker.errors``, ``worker.ids``, ``worker.engine.sampling_params`` and the
engine's plain values, ``kvserve_model``, MLX and mlx-lm. Never gRPC or protos.
"""
