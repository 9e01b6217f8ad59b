"""The engine half of the worker: continuous batching on leased blocks.

``loop`` (the step loop and request endings), ``scheduler`` (pure batching policy),
``sequence`` (one request's state), ``intake`` (every check before a request is queued),
``lease_sync`` / ``lease`` (everything said to the cache service, through the ``LeaseService``
protocol, and its values), ``executor`` (the MLX thread the model runs on), ``step_budget``,
``outage``, ``sampling_params``. It drives the model path (``worker.model``) only through the
executor.

May import: ``worker.model``, ``worker.errors``, ``worker.ids``, ``kvserve_model``. Never gRPC
or protos, and nothing of the edge (``worker.server``, ``worker.servicer``,
``worker.lease_client``): the assembly hands the engine its lease client, which implements
``lease.LeaseService``. ``scheduler``, ``sequence``, ``lease`` and ``sampling_params`` import no
MLX either (tests/test_import_rules.py).
"""
