"""The engine half of the worker: continuous batching on leased blocks.

``loop`` (the step loop and request endings), ``scheduler`` (pure batching policy),
``sequence`` (one request's state), ``intake`` (every check before a request is queued),
``lease_sync`` / ``lease_client`` / ``lease`` (everything said to the cache service, and its
values), ``executor`` (the MLX thread the model runs on), ``step_budget``, ``outage``,
``sampling_params``. It drives the model path (``worker.model``) only through the executor.

May import: ``worker.model``, ``worker.errors``, ``worker.ids``, ``kvserve_model``,
``kvserve_proto`` (``lease_client`` only). Imports nothing back from ``worker.server`` or
``worker.servicer``. ``scheduler``, ``sequence``, ``lease`` and ``sampling_params`` import no
MLX, gRPC or protos (tests/test_import_rules.py).
"""
