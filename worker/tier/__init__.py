"""The worker's KV tiers: where blocks its pool no longer holds are kept (docs/kv-tiers.md).

``block_file`` is one spilled block on disk (header, checks, payload); ``disk`` the disk tier
(a directory of them, scanned at start, written atomically); ``host`` the host-memory tier
(CUDA: a device with memory of its own); ``store`` what the engine talks to: spill on commit
(write-through, off the step path), load on a grant's ``tier_blocks`` (checked, before the
blocks are read), and the reports to the cache service (``UpdateTiers``).

No MLX here: the pool's bytes come and go through ``KVPool.read_blocks`` and
``KVPool.write_blocks`` on the model thread.
"""
