"""The import rules of docs/architecture.md ("Import rules"), enforced.

Statically: every import statement of every .py file of the six top-level packages (function-local
ones and those under ``if TYPE_CHECKING`` included) names only packages its package may import;
inside the worker, the engine and the model path import nothing of the layers above them
(``INSIDE``).
Dynamically: importing a process's entry module in a fresh interpreter loads none of what that
process must not load, whatever path it takes to get there (the static check sees one file at a
time; this one sees the whole import graph).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("kvcache_service", "worker", "gateway", "kvserve_launch", "kvserve_model", "kvserve_proto")
MLX = ("mlx", "mlx_lm")
RPC = ("grpc", "grpc_health", "grpc_reflection", "google", "kvserve_proto")

# Of our packages, which each may import (besides itself).
MAY_IMPORT: dict[str, set[str]] = {
    "kvserve_proto": set(),
    "kvserve_model": set(),
    "kvserve_launch": {"kvserve_model"},
    "kvcache_service": {"kvserve_launch", "kvserve_proto"},
    "worker": {"kvserve_model", "kvserve_launch", "kvserve_proto"},
    "gateway": {"kvserve_model", "kvserve_launch", "kvserve_proto"},
}
# Third-party packages each must not import: only the worker runs a model.
MUST_NOT_IMPORT: dict[str, set[str]] = {
    "kvserve_proto": {*MLX},
    "kvserve_model": {*MLX, *RPC},
    "kvserve_launch": {*MLX},
    "kvcache_service": {*MLX},
    "worker": set(),
    "gateway": {*MLX},
}
# (file, package): why it may. Each exception is for imports inside functions only.
EXCEPTIONS = {
    ("kvserve_model/blas.py", "mlx"): "measures MLX's CPU backend, asks MLX whether a GPU is there",
    ("kvcache_service/admin_cli.py", "kvserve_model"): (
        "the operator's CLI tokenizes text prefixes with the pools' model; the service never"
    ),
}

# Inside the worker (docs/worker-engine.md): the model path sits below the engine, and both below
# the edge (the gRPC servicer and lease client) and the assembly (config, device defaults, the
# server, the model's setup, the warm-up), which turns config into the plain values the layers
# below take. Each entry: the folder, and the modules (or packages, with everything under them)
# its files must not import, function-local and ``TYPE_CHECKING`` imports included. No exceptions.
EDGE = ("worker.server", "worker.servicer", "worker.generate_many", "worker.lease_client")
ASSEMBLY = (
    "worker.config",
    "worker.device_defaults",
    "worker.model_setup",
    "worker.warmup",
    "worker.warmup_plan",
)
INSIDE: dict[str, tuple[str, ...]] = {
    "worker/model": ("worker.engine", *ASSEMBLY, *EDGE, *RPC),
    "worker/engine": (*ASSEMBLY, *EDGE, *RPC),
}


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, inside a function) for every import statement in ``path``."""
    return _imports_in(path.read_text(), path.relative_to(ROOT).parent.parts)


def _imports_in(source: str, package: tuple[str, ...]) -> list[tuple[str, int, bool]]:
    tree = ast.parse(source)
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name.split(".")[0], node.lineno, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((module.split(".")[0], node.lineno, in_function))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def _modules_in(source: str, package: tuple[str, ...]) -> list[tuple[str, int]]:
    """(module, line) for every module an import statement of ``source`` may load, by its full
    dotted name: ``import a.b`` names ``a.b``; ``from a import b`` names ``a`` and ``a.b`` (``b``
    may be a module); relative imports are resolved against ``package``."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found.extend((f"{module}.{a.name}", node.lineno) for a in node.names)
    return found


def _names(module: str, forbidden: tuple[str, ...]) -> str | None:
    """The entry of ``forbidden`` that ``module`` is, or is inside of; None if none."""
    return next((f for f in forbidden if module == f or module.startswith(f + ".")), None)


def _files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_checker_sees_every_kind_of_import() -> None:
    source = (
        "import a.b, c\n"
        "from d.e import f\n"
        "from . import g\n"
        "from ..h import i\n"
        "if TYPE_CHECKING:\n"
        "    import j\n"
        "def k():\n"
        "    import mlx.core\n"
        "    class L:\n"
        "        from m import n\n"
        "async def o():\n"
        "    from p import q\n"
    )
    found = [(m, f) for m, _, f in _imports_in(source, ("gateway", "sub"))]
    assert found == [
        ("a", False),
        ("c", False),
        ("d", False),
        ("gateway", False),
        ("gateway", False),
        ("j", False),
        ("mlx", True),
        ("m", True),
        ("p", True),
    ]


@pytest.mark.parametrize("package", OURS)
def test_static_imports_follow_the_rules(package: str) -> None:
    files = _files(package)
    assert files
    broken = []
    for path in files:
        name = str(path.relative_to(ROOT))
        for module, line, in_function in _imports(path):
            ours = module in OURS and module != package and module not in MAY_IMPORT[package]
            if ours or module in MUST_NOT_IMPORT[package]:
                if (name, module) in EXCEPTIONS and in_function:
                    continue
                broken.append(f"{name}:{line} imports {module}")
    assert not broken, "import rules (docs/architecture.md) broken:\n" + "\n".join(broken)


def test_every_exception_is_still_needed() -> None:
    for file, module in EXCEPTIONS:
        assert any(m == module for m, _, _ in _imports(ROOT / file)), (file, module)


def test_the_dotted_checker_sees_submodules() -> None:
    source = (
        "import worker.engine.loop\n"
        "from worker import config\n"
        "from worker.engine.lease import Lease\n"
        "def f():\n"
        "    from ..engine import scheduler\n"
        "if TYPE_CHECKING:\n"
        "    from grpc import aio\n"
    )
    found = {m for m, _ in _modules_in(source, ("worker", "model"))}
    assert {"worker.engine.loop", "worker.config", "worker.engine.lease", "grpc"} <= found
    assert "worker.engine.scheduler" in found
    assert _names("worker.engine.lease.Lease", ("worker.engine",)) == "worker.engine"
    assert _names("worker.engines", ("worker.engine",)) is None
    assert _names("grpc.aio", RPC) == "grpc"


@pytest.mark.parametrize("folder", INSIDE)
def test_inside_the_worker_no_layer_imports_one_above_it(folder: str) -> None:
    """``worker/model`` imports nothing of the engine, the assembly or the edge; ``worker/engine``
    nothing of the assembly or the edge (it is handed its lease client:
    ``worker.engine.lease.LeaseService``); neither imports gRPC or the protos."""
    files = sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    assert files
    broken = []
    for path in files:
        package = path.relative_to(ROOT).parent.parts
        lines = set()  # one report a statement: `from a import b` names a and a.b
        for module, line in _modules_in(path.read_text(), package):
            if (hit := _names(module, INSIDE[folder])) is not None and line not in lines:
                lines.add(line)
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({hit})")
    assert not broken, f"{folder} imports a layer above it:\n" + "\n".join(broken)


@pytest.mark.parametrize("package", OURS)
def test_each_package_says_what_it_owns_and_may_import(package: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and "May import" in doc, f"{package}/__init__.py: say what it owns and may import"


def _loaded_after(code: str) -> set[str]:
    """The top-level packages loaded in a fresh interpreter after running ``code``."""
    tops = "sorted({m.split('.')[0] for m in sys.modules})"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({tops}))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_gateway_process_never_loads_mlx_or_the_worker() -> None:
    """Importing the gateway and loading its tokenizer (what ``python -m gateway`` does before
    it serves) loads no MLX, no mlx-lm, nothing of the worker's or the cache service's."""
    loaded = _loaded_after(
        "import gateway.server, gateway.__main__\n"
        "from gateway.tokenizer import Tokenizer\n"
        "tokenizer = Tokenizer.load('kvserve-tiny-llama')\n"
        "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}])"
    )
    assert "gateway" in loaded and "transformers" in loaded
    assert not loaded & {*MLX, "worker", "kvcache_service"}


def test_the_cache_service_loads_no_mlx_worker_or_gateway() -> None:
    """Nor numpy, until a client sends token ids as a repeated field (12 of its ~40 MiB)."""
    loaded = _loaded_after("import kvcache_service.server, kvcache_service.__main__")
    assert "kvcache_service" in loaded
    assert not loaded & {*MLX, "worker", "gateway", "kvserve_model", "numpy"}


def test_the_shared_package_and_the_launcher_load_no_mlx_and_no_service() -> None:
    modules = [p.stem for p in _files("kvserve_model") if p.stem != "__init__"]
    loaded = _loaded_after(
        "\n".join(f"import kvserve_model.{m}" for m in modules)
        + "\nimport kvserve_launch.system, kvserve_launch.__main__"
    )
    assert {"kvserve_model", "kvserve_launch"} <= loaded
    assert not loaded & {*MLX, "worker", "gateway", "kvcache_service", "kvserve_proto"}


def test_the_launcher_holds_no_mlx_after_choosing_the_blas_and_the_model() -> None:
    """What the launcher runs before it starts the services (the BLAS for its children, the
    model resolved) loads no MLX: whether MLX has a GPU is asked in a child process."""
    loaded = _loaded_after(
        "from kvserve_model.blas import fast_blas_env\n"
        "from kvserve_model.resolve import resolve_model\n"
        "fast_blas_env()\n"
        "resolve_model('kvserve-tiny-llama')"
    )
    assert "kvserve_model" in loaded
    assert not loaded & {*MLX}


def test_the_launcher_holds_no_grpc_while_it_waits_for_the_system() -> None:
    """The launcher's own work (its TLS checks and the /health poll's ssl context) loads no
    gRPC: it talks to its children over HTTP and their output (grpc was 10 of its 53 MiB)."""
    loaded = _loaded_after(
        "import kvserve_launch.system, kvserve_launch.__main__\n"
        "from kvserve_launch.tls import check_server, client_ssl_context\n"
        "check_server('', '')"
    )
    assert "kvserve_launch" in loaded
    assert not loaded & {"grpc", "grpc_health"}, sorted(loaded & {"grpc", "grpc_health"})


def test_the_engine_and_the_model_path_load_no_rpc_and_no_edge() -> None:
    """Whatever path their imports take: the engine's loop and the model's runners load no gRPC,
    no protos and nothing of the worker's edge or assembly (it is the assembly that builds the
    lease client and the runner's plain values, and hands them in)."""
    loaded = _loaded_after(
        "import worker.engine.loop, worker.engine.intake\n"
        "import worker.model.runner, worker.model.dense_runner, worker.model.draft\n"
        "import sys\n"
        f"above = sorted(m for m in sys.modules if m in {[*ASSEMBLY, *EDGE]!r})\n"
        "assert not above, above"
    )
    assert "worker" in loaded and "mlx" in loaded
    assert not loaded & {*RPC}, sorted(loaded & {*RPC})


def test_the_scheduler_imports_no_mlx_and_no_rpc() -> None:
    """worker/engine/scheduler.py is pure policy: no MLX, no gRPC, no generated protos (its value types
    come from pure modules, not from the RPC client)."""
    loaded = _loaded_after("import worker.engine.scheduler")
    assert not loaded & {*MLX, *RPC}, sorted(loaded & {*MLX, *RPC})
