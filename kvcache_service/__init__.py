"""The KV-cache authority: block metadata, radix index, leases and budget for worker pools.

Owns: which blocks of each registered pool are free, leased or cached, the prefix index over
them, leases and their expiry, eviction, and the admin operations; metadata only, no tensors
and no model.

May import: ``kvserve_proto`` (at its edges: server, servicer, converters, admin CLI),
``kvserve_launch``'s startup, TLS and malformed-request helpers, grpc. Never ``worker``,
``gateway`` or ``kvserve_model``, never ``mlx`` (docs/architecture.md, "Import rules";
tests/test_import_rules.py).
"""
