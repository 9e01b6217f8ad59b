"""The kvserve gateway: OpenAI-compatible REST and the workers' gRPC Generate on one address,
routing each request to the worker whose KV pool already holds the longest prefix.

Owns: the HTTP and gRPC edges, tokenizing (chat templates), routing, fail-over, streaming,
metrics and the admin pass-through.

May import: ``kvserve_model`` (tokenizer, context length, sampling limits), ``kvserve_launch``'s
startup and TLS helpers, ``kvserve_proto``. Never ``worker`` or ``kvcache_service``: it reaches
them only over gRPC; never ``mlx`` or ``mlx_lm``: the gateway runs no model
(docs/architecture.md, "Import rules"; tests/test_import_rules.py).
"""
