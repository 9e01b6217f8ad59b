"""Generated from proto/ by `make proto` (scripts/protogen.py): the gRPC contracts'
messages and stubs (kvcache.v1, worker.v1). Do not edit; `packed_tokens` and `block_keys`
are hand-written.

May import: protobuf, grpc and xxhash only. Imported only at the processes' edges (servers,
servicers, converters, clients; `packed_tokens` also where tokens are checked, `block_keys`
where blocks are named), never by domain code otherwise nor by kvserve_model (docs/architecture.md, "Import rules").
"""
