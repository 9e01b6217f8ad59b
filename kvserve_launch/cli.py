"""``kvserve``: the one command on PATH, as the ecosystem spells it (``vllm serve MODEL``,
``mlx_lm.server --model MODEL``).

    kvserve serve [MODEL] [FLAGS]    the whole system (cache service, workers, gateway) until
                                     Ctrl-C; MODEL as --model takes it (default: the default
                                     model); every flag of ``python -m kvserve_launch``
    kvserve admin [FLAGS] COMMAND    the cache's admin CLI (``kvserve-admin``)
    kvserve convert FILE.gguf        convert a GGUF file once into the models cache, print
                                     the directory (what ``--model FILE.gguf`` does first)

``admin`` runs ``kvcache_service.admin_cli`` in this interpreter (the launcher imports nothing
of the cache service's: docs/architecture.md, "Import rules").
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Sequence

USAGE = __doc__.split("\n\n")[1]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "serve":
        return serve(rest)
    if command == "admin":
        os.execv(sys.executable, [sys.executable, "-m", "kvcache_service.admin_cli", *rest])
    if command == "convert" and len(rest) == 1:
        return convert(rest[0])
    if command in ("-h", "--help"):
        print(f"usage:\n{USAGE}")
        return 0
    print(f"usage:\n{USAGE}", file=sys.stderr)
    return 2


def serve(argv: list[str]) -> int:
    from kvserve_launch.__main__ import main as launch_main
    from kvserve_launch.config import SETTINGS, check

    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    settings = copy.copy(SETTINGS)
    settings.prog = "kvserve serve [MODEL]"
    return launch_main(cfg=settings.parse(argv, check))


def convert(path: str) -> int:
    from kvserve_model.errors import ModelLoadError
    from kvserve_model.resolve import resolve_model

    try:
        print(resolve_model(path))
    except ModelLoadError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
