"""The KV-cache authority: block metadata, radix index, leases and budget for worker pools."""
