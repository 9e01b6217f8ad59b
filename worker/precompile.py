"""CUDA kernels compiled in a child process while the worker imports mlx-lm and loads weights.

A cold worker on an NVIDIA GPU spent most of its start in two serial waits (H100, 1B fp16 llama,
empty kernel cache): 14 s importing ``mlx_lm`` (it imports ``transformers``, which on a machine
with PyTorch installed imports torch, sympy and scikit-learn), then 21.6 s in the self-check,
nearly all of it NVRTC compiling MLX's kernels and kvserve's block-table kernels on their first
use (3.98 s once they were cached on disk). The compiling needs the model's shapes, not
transformers, so it can run during the import.

So at start, where MLX has CUDA, the worker spawns ``python -m worker.precompile MODEL_DIR
BLOCK_SIZE``: a process that registers ``mlx_lm`` *without* running its ``__init__`` (whose
``mlx_lm.utils`` imports transformers; ``mlx_lm.models.*`` import only MLX), builds the model
from the directory as ``mlx_lm.utils.load_model`` does (weights, ``sanitize``, the same
quantization predicate, the worker's compute dtype) and runs the worker's own self-check on a
pool of the worker's block size: every kernel the worker's self-check will meet is compiled,
into a private PTX cache (``MLX_PTX_CACHE_DIR``), seeded first with what the worker's cache
already holds (a restart compiles nothing: without the seed the child of a second start spent
32 s compiling what the worker would have read in 5). Before its own self-check the worker waits for
the child (bounded) and publishes what it compiled into its cache: MLX writes and reads that
cache without locks or renames (``jit_module.cpp``), so two processes sharing it could read a
half-written file; each file is copied under a temporary name and renamed, the ``.ptx`` last,
and existing files are kept.

The child holds a second copy of the weights while the worker loads its own, so it runs only
for a model whose weights take at most :data:`MAX_WEIGHTS_SHARE` of the GPU's free memory.
Best effort throughout: a child that fails, or a model it cannot build, costs nothing but the
work the worker then does itself, as it did before.

Measured (H100, the 1B fp16 llama, empty caches; one run each, the machine's own noise about
+-5 s): ready 36.9 s without the child, 31.9 and 38.0 s with it (the child's compiling took
24.6 and 29.7 s of it); a restart with the caches kept 19.6 s without, 23.7 s with (the child
done long before the import, the worker's own self-check 5.6 s either way).
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

WAIT_S = 120.0  # the longest the worker waits for the child before its own self-check
MAX_WEIGHTS_SHARE = 0.25  # of the GPU's free memory: the child's copy must never crowd the worker
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
SEED_ENV = "KVSERVE_PRECOMPILE_SEED"  # the worker's cache, which the child copies first


@dataclass
class Precompile:
    """A running child and its private cache."""

    process: subprocess.Popen[bytes]
    cache: Path
    started: float


def ptx_cache_dir() -> Path:
    """Where this process's MLX keeps compiled CUDA kernels: ``MLX_PTX_CACHE_DIR``, else
    ``$TMPDIR/mlx/<version>/ptx``."""
    import mlx.core as mx

    explicit = os.environ.get(PTX_CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / "mlx" / str(getattr(mx, "__version__", "")) / "ptx"


def start(model_dir: Path, block_size: int) -> Precompile | None:
    """Spawn the child (only where MLX runs on CUDA); None where there is nothing to do."""
    from worker.model.device import cuda_available

    if not cuda_available():
        return None
    from worker.device_defaults import free_memory

    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    free = free_memory("gpu")
    if free is None or weights > MAX_WEIGHTS_SHARE * free:
        return None
    cache = Path(tempfile.mkdtemp(prefix="kvserve-precompile-"))
    env = {**os.environ, PTX_CACHE_ENV: str(cache), SEED_ENV: str(ptx_cache_dir())}
    argv = [sys.executable, "-m", "worker.precompile", str(model_dir), str(block_size)]
    try:
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
    except OSError as e:
        log.info("kernel precompile not started: %s", e)
        shutil.rmtree(cache, ignore_errors=True)
        return None
    return Precompile(process, cache, time.perf_counter())


def finish(pre: Precompile | None, wait_s: float = WAIT_S) -> None:
    """Wait for the child (at most ``wait_s``), publish what it compiled, clean up."""
    if pre is None:
        return
    try:
        try:
            _, err = pre.process.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pre.process.kill()
            _, err = pre.process.communicate()
            log.info("kernel precompile stopped after %.0f s", wait_s)
        last = (err or b"").decode(errors="replace").strip().splitlines()[-1:]
        if pre.process.returncode != 0:
            log.info("kernel precompile failed (%s): compiling here", last[0] if last else "")
        else:
            log.info("kernel precompile child: %s", last[0] if last else "")
        published = publish(pre.cache, ptx_cache_dir())
        log.info(
            "kernel precompile: %d modules compiled beside the imports in %.1f s",
            published,
            time.perf_counter() - pre.started,
        )
    finally:
        shutil.rmtree(pre.cache, ignore_errors=True)


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


def build_model(model_dir: Path) -> Any:
    """The model of ``model_dir`` as the worker builds it (``mlx_lm.utils.load_model`` without
    transformers, ``worker.model.mlx_lm_light``), in the worker's compute dtype."""
    import mlx.core as mx

    from worker.model.loader import compute_dtype

    model, config = mlx_lm_light.utils().load_model(model_dir)
    dtype = compute_dtype(config, cpu=mx.default_device() == mx.cpu)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def main(argv: list[str]) -> int:
    model_dir, block_size = Path(argv[0]), int(argv[1])
    t0 = time.perf_counter()
    seed, own = os.environ.get(SEED_ENV), os.environ.get(PTX_CACHE_ENV)
    if seed and own and Path(seed).is_dir():
        publish(Path(seed), Path(own))  # what is compiled already is read, not compiled again
    mlx_lm_light.register_package()
    from worker.model.runner import ModelRunner
    from worker.model.self_check import check_paged_parity

    t1 = time.perf_counter()
    model = build_model(model_dir)
    t2 = time.perf_counter()
    runner = ModelRunner.create(model, block_size=block_size, num_blocks=64)
    runner.choose_decode_attention()
    result = check_paged_parity(model, runner=runner)
    print(
        f"imports {t1 - t0:.1f} s, model {t2 - t1:.1f} s, runner and self-check "
        f"{time.perf_counter() - t2:.1f} s: {result.describe()}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    code = 1
    with contextlib.suppress(KeyboardInterrupt):
        code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # MLX may abort in its C++ teardown after GPU work (kvserve_launch.run)
