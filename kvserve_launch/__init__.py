"""One command for the whole system on one machine: ``python -m kvserve_launch`` (``make run``)
starts the cache service, N workers and the gateway, and stops them all on Ctrl-C.

Owns: the launcher (config, children, diagnosis of their exits, the container health check),
and the helpers every service shares at its edge: its flags and variables (``settings``), the
TLS and logging fields every config has (``common_flags``), its run-until-signal main (``run``), how a startup failure is reported (``startup``), TLS
credentials (``tls``), the malformed-request interceptor (``malformed``), status codes sent as
numbers (``grpc_status``).

May import: ``kvserve_model`` (the default model, the BLAS environment for workers), grpc.
Never ``kvcache_service``, ``worker`` or ``gateway`` (it starts them as processes), nor
``mlx`` (docs/architecture.md, "Import rules"; tests/test_import_rules.py).
"""
