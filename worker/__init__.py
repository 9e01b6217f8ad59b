"""The kvserve worker: an mlx-lm model running on a paged KV pool whose blocks a central
cache service leases out."""
