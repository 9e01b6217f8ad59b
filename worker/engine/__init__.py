"""The engine half of the worker: continuous batching on leased blocks.

``loop`` (the step loop and request endings), ``scheduler`` (pure batching policy) and ``step``
(what it schedules), ``sequence`` (one request's state, its fields grouped by the one owner that
writes them), ``final_hold`` (a finished request's last event, held until its KV is indexed),
``intake`` (every check before a request is queued), ``lease_sync`` / ``admission`` /
``release_queue`` / ``lease`` (everything said to the cache service, through the
``LeaseService`` protocol, and its values), ``executor`` / ``lookahead`` (the MLX thread the
model runs on), ``speculation``, ``step_budget``, ``outage``, ``sampling_params``. It drives the
model path (``worker.model``) only through the executor.

May import: ``worker.model``, ``worker.errors``, ``worker.ids``, ``kvserve_model``. Never gRPC
or protos, nothing of the edge (``worker.server``, ``worker.servicer``, ``worker.generate_many``,
``worker.lease_client``) and nothing of the assembly (``worker.config``, ...): the assembly
hands the engine plain values and its lease client, which implements ``lease.LeaseService``.
``scheduler``, ``sequence``, ``lease`` and ``sampling_params`` import no MLX either
(tests/test_import_rules.py).
"""
