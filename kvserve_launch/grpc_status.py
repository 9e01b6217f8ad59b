"""gRPC status codes carried as numbers inside messages (a batched call's per-item error, one
request's error inside a shared stream): the number back to its ``grpc.StatusCode``."""

from __future__ import annotations

import grpc

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode | None:
    """The status code numbered ``number`` (google.rpc.Code), None for an unknown one."""
    return _BY_NUMBER.get(number)
