"""What a pool id (the worker's name) and the other strings a worker registers may hold.

They are stored for the pool's lifetime, sent back in every Stats and Route answer and
printed by the admin CLI: bounded and printable (a pool id: printable ASCII without spaces),
so a 1 MB id or one holding a newline or a terminal escape is refused at registration
(INVALID_ARGUMENT).
"""

from __future__ import annotations

import re

from kvcache_service.errors import InvalidArgument

MAX_ID_CHARS = 128  # pool ids; a host name and a port fit many times over
MAX_NAME_CHARS = 256  # addresses, model names and fingerprints
_PRINTABLE_ASCII = re.compile(r"[\x21-\x7e]*")


def check_id(value: str, what: str, limit: int = MAX_ID_CHARS) -> str:
    """An identifier: printable ASCII, no spaces."""
    if len(value) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters")
    if not _PRINTABLE_ASCII.fullmatch(value):
        raise InvalidArgument(f"{what} must be printable ASCII without spaces")
    return value


def check_name(value: str, what: str, limit: int = MAX_NAME_CHARS) -> str:
    """A free-form name (a model directory may hold spaces or non-ASCII letters): printable."""
    if len(value) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters")
    if not value.isprintable():
        raise InvalidArgument(f"{what} holds non-printable characters")
    return value
