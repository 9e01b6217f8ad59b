"""Generated from proto/ by `make proto` (scripts/protogen.py): the gRPC contracts'
messages and stubs (kvcache.v1, worker.v1). Do not edit; `packed_tokens` is hand-written.

May import: protobuf and grpc only. Imported only at the processes' edges (servers, servicers,
converters, clients; `packed_tokens` also where tokens are checked), never by domain code nor
by kvserve_model (docs/architecture.md, "Import rules").
"""
