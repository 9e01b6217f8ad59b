"""Kernels compiled in child processes while the worker compiles its own, for its self-check.

A cold worker on an NVIDIA GPU waits on NVRTC for most of its start: MLX compiles each kernel
module on its first use, one after another, 3-6 s each on an H200 host (``bench/gpu/
jit_costs.py``: a gather 3.3-6.4 s, the pool write's scatter 4.6 s, mlx-lm's compiled
``swiglu`` 5.2 s a shape class), and caches it on disk (``$TMPDIR/mlx/<version>/ptx`` or
``MLX_PTX_CACHE_DIR``), so a restart reads them in milliseconds. The self-check's first paged
forward took 26.9 s cold, 5.3 s with the cache kept (1B fp16 llama; ``bench/gpu/
selfcheck_profile.py``).

The compiles of one process are serial, but other processes can compile the same modules
meanwhile. So at start, where MLX has CUDA, the worker spawns one child per :data:`ROLES`
(``python -m worker.precompile MODEL_DIR BLOCK_SIZE ROLE``): each registers ``mlx_lm`` without
its ``__init__`` (``worker.model.mlx_lm_light``), builds the model as the worker does, and runs
the self-check's **dense** reference forwards (``worker.model.self_check.DenseSequence``:
mlx-lm's own forward, which holds every model-level module the paged path meets: the
embedding's gather, the compiled activations of prefill and of decode shapes) in its own order:
the prompts first in one child, one-token forwards first in the other. The worker meanwhile
compiles the modules only its paged path has (the pool's scatter, kvserve's block-table kernels)
and, by the time its forwards reach a model-level module, finds it compiled. Each child
compiles into a private cache (seeded with what the worker's cache holds, so a restart compiles
nothing) and, after each forward (when MLX has closed every file it wrote), publishes it into
the worker's cache. MLX writes and reads that cache without locks or renames
(``jit_module.cpp``), so two processes sharing it could read a half-written file: each file is
copied under a temporary name and renamed, the ``.ptx`` (the file MLX reads first) last, and
existing files are kept. Once the worker's self-check is over, the children are stopped
(:func:`finish`).

Not covered: ``mx.fast.cuda_kernel`` kernels (kvserve's block-table kernels) are not written to
MLX's disk cache (mlx-cuda 0.32), so the worker compiles them itself at every start, 1.4-2.3 s
each.

The children hold a copy of the weights each while the worker loads its own, so they run only
for a model whose weights, times the children, take at most :data:`MAX_WEIGHTS_SHARE` of the
GPU's free memory. Best effort throughout: a child that fails, or a model it cannot build, costs
nothing but the work the worker then does itself.

Measured (H200, the 1B fp16 llama, empty caches, one call; docs/benchmarks.md): ready after
22.6 and 27.3 s with the children (the self-check 18.4 and 22.8 s), 32.5 s without (27.3 s);
the single child that ran the whole self-check before the worker's own gave 37.9 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.model import mlx_lm_light

log = logging.getLogger(__name__)

# The children's orders of the self-check's dense forwards: the prompts first (prefill-shaped
# modules), or one-token forwards first (decode-shaped modules).
ROLES = ("prompts-first", "steps-first")
MAX_WEIGHTS_SHARE = 0.25  # of the GPU's free memory, all children's copies together
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
TARGET_ENV = "KVSERVE_PRECOMPILE_TARGET"  # the worker's cache: seeds a child, takes its modules
DONE = "published"  # a child's line after each forward


@dataclass
class Child:
    role: str
    process: subprocess.Popen[bytes]
    cache: Path
    log: Path  # its stderr


@dataclass
class Precompile:
    """The running children and the cache they publish into."""

    children: list[Child]
    target: Path
    started: float


def ptx_cache_dir() -> Path:
    """Where this process's MLX keeps compiled CUDA kernels: ``MLX_PTX_CACHE_DIR``, else
    ``$TMPDIR/mlx/<version>/ptx``."""
    import mlx.core as mx

    explicit = os.environ.get(PTX_CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / "mlx" / str(getattr(mx, "__version__", "")) / "ptx"


def start(model_dir: Path, block_size: int, roles: tuple[str, ...] = ROLES) -> Precompile | None:
    """Spawn the children (only where MLX runs on CUDA), each publishing into this process's
    kernel cache as it goes; None where there is nothing to do."""
    from worker.model.device import cuda_available

    if not cuda_available() or not roles:
        return None
    from worker.device_defaults import free_memory

    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    free = free_memory("gpu")
    if free is None or len(roles) * weights > MAX_WEIGHTS_SHARE * free:
        return None
    target = ptx_cache_dir()
    pre = Precompile([], target, time.perf_counter())
    for role in roles:
        cache = Path(tempfile.mkdtemp(prefix=f"kvserve-precompile-{role}-"))
        env = {**os.environ, PTX_CACHE_ENV: str(cache), TARGET_ENV: str(target)}
        argv = [sys.executable, "-m", "worker.precompile", str(model_dir), str(block_size), role]
        err = cache.with_suffix(".log")
        try:
            with err.open("wb") as stderr:
                process = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )  # fmt: skip
        except OSError as e:
            log.info("kernel precompile %s not started: %s", role, e)
            shutil.rmtree(cache, ignore_errors=True)
            err.unlink(missing_ok=True)
            continue
        pre.children.append(Child(role, process, cache, err))
    return pre if pre.children else None


def finish(pre: Precompile | None) -> None:
    """Stop the children (the worker's self-check is over: what they would still compile, it
    has compiled itself), clean up. Idempotent."""
    if pre is None or not pre.children:
        return
    children, pre.children = pre.children, []
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    for child in children:
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        # A child stopped while it published leaves a temporary file, which MLX never reads.
        for partial in pre.target.glob(f".*.{child.process.pid}.*"):
            partial.unlink(missing_ok=True)
        lines = child.log.read_text(errors="replace").strip().splitlines()
        published = sum(1 for line in lines if line.startswith(DONE))
        code = child.process.returncode
        last = lines[-1] if lines else ""
        state = "done" if code == 0 else "stopped" if code < 0 else f"failed ({last})"
        log.info("kernel precompile %s: %d forwards published, %s", child.role, published, state)
        shutil.rmtree(child.cache, ignore_errors=True)
        child.log.unlink(missing_ok=True)
    log.info("kernel precompile: children ran %.1f s", time.perf_counter() - pre.started)


def publish(source: Path, target: Path) -> int:
    """Copy the modules of cache ``source`` into cache ``target`` so that a reader never sees
    a partial one: each file under a temporary name, then renamed; a module's ``.ptx`` (the
    file MLX looks for first) after its ``.txt`` and ``.cu``; files already there are kept.
    Returns the modules copied."""
    copied = 0
    for ptx in sorted(source.rglob("*.ptx")):
        rel = ptx.relative_to(source)
        dest = target / rel
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".txt", ".cu", ".ptx"):
            src = ptx.with_suffix(suffix)
            if not src.exists():
                continue
            tmp = dest.with_name(f".{dest.stem}.{os.getpid()}{suffix}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest.with_suffix(suffix))
        copied += 1
    return copied


# -- the child ----------------------------------------------------------------------------------


def forwards(model: Any, block_size: int, role: str) -> list[tuple[str, Any]]:
    """The self-check's dense forwards (its prompts, then one step each) in ``role``'s order:
    ``prompts-first``, or ``steps-first`` (a one-token prompt and its steps before the
    prompts). Token ids below 100: any vocabulary has them, and no kernel depends on them."""
    from worker.model.self_check import DenseSequence, reference_prompts

    prompts = [
        (f"prompt of {len(p)}", lambda p=p: DenseSequence(model, p))
        for p in reference_prompts(block_size, 100)
    ]

    def steps() -> None:
        seq = DenseSequence(model, [1])
        for t in (2, 3):
            seq.step(t)

    first_steps = [("one-token prompt and steps", steps)]
    return first_steps + prompts if role == "steps-first" else prompts + first_steps


def main(argv: list[str]) -> int:
    model_dir, block_size = Path(argv[0]), int(argv[1])
    role = argv[2] if len(argv) > 2 else ROLES[0]
    if role not in ROLES:
        print(f"unknown role {role!r}: one of {', '.join(ROLES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    target, own = os.environ.get(TARGET_ENV), os.environ.get(PTX_CACHE_ENV)
    if target and own and Path(target).is_dir():
        publish(Path(target), Path(own))  # what is compiled already is read, not compiled again
    mlx_lm_light.register_package()
    t1 = time.perf_counter()
    from worker.model.loader import build_model

    model, _ = build_model(model_dir)
    t2 = time.perf_counter()
    for name, run in forwards(model, block_size, role):
        t = time.perf_counter()
        run()
        # MLX wrote each module whole during the forward: the worker may read them now.
        count = publish(Path(own), Path(target)) if target and own else 0
        print(f"{DONE} {name}: {count} new modules in {time.perf_counter() - t:.2f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"{role}: imports {t1 - t0:.1f} s, model {t2 - t1:.1f} s, forwards "
        f"{time.perf_counter() - t2:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    code = 1
    with contextlib.suppress(KeyboardInterrupt):
        code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # MLX may abort in its C++ teardown after GPU work (kvserve_launch.run)
