"""Generated from proto/ by `make proto` (scripts/protogen.py): the gRPC contracts'
messages and stubs (kvcache.v1, worker.v1). Do not edit, but for the one hand-written module:
`packed_tokens` (the compact token form some of the messages' fields carry).

May import: protobuf and grpc only. Imported only at the processes' edges (servers,
servicers, converters, clients), never by domain code nor by kvserve_model
(docs/architecture.md, "Import rules"); `packed_tokens`, standard library only, wherever
tokens are checked at the door.
"""
