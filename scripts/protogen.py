"""Generate kvserve_proto/ from proto/ (the one command: `make proto`).

The generated package is committed so that a fresh checkout imports without a build step;
tests/test_proto_up_to_date.py regenerates into a temporary directory and fails when the
committed files differ. grpcio-tools is pinned in pyproject.toml so the output is stable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "kvserve_proto"
# Hand-written modules of the package, beside the generated ones: generate() leaves them alone
# and tests/test_proto_up_to_date.py does not compare them.
HAND_WRITTEN = ("packed_tokens.py", "block_keys.py")
# The top package's __init__.py: what tests/test_import_rules.py asks of every package.
PACKAGE_DOC = '''"""Generated from proto/ by `make proto` (scripts/protogen.py): the gRPC contracts'
messages and stubs (kvcache.v1, worker.v1). Do not edit; `packed_tokens` and `block_keys`
are hand-written.

May import: protobuf, grpc and xxhash only. Imported only at the processes' edges (servers,
servicers, converters, clients; `packed_tokens` also where tokens are checked, `block_keys`
where blocks are named), never by domain code otherwise nor by kvserve_model (docs/architecture.md, "Import rules").
"""
'''


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE).rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes the generated modules (and package __init__ files) under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for d in [out_dir / PACKAGE, *(p for p in (out_dir / PACKAGE).rglob("*") if p.is_dir())]:
        if d.name != "__pycache__":
            (d / "__init__.py").touch()
    (out_dir / PACKAGE / "__init__.py").write_text(PACKAGE_DOC)
    return sorted(p for p in (out_dir / PACKAGE).rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
