"""PyTorch kept out of kvserve's processes.

``transformers`` imports PyTorch wherever it is installed, as soon as a tokenizer loads (sympy
and more with it; ``tests/model/test_torchless.py`` shows the import): on an H100 host whose
Python has PyTorch, ``mlx_lm.tokenizer_utils`` (transformers, and through it torch, sympy and
scikit-learn) took 12.7 s of the worker's imports (``python -X importtime``), and on an H200
host a tokenizer took 12-15 s to load in the worker and the gateway alike, where it takes
1-1.5 s on a machine without PyTorch. No kvserve process uses PyTorch: tokenizers, chat
templates and grammars are plain Python, Rust and numpy. Measured with it on an H200 host
with PyTorch (docs/benchmarks.md): the tokenizer loads in 1.9-2.2 s, the gateway is ready in
5.8-6.1 s (13.7-15.0 before), a restart of the whole system in 11.2 s (15.5).

:func:`keep_torch_out` marks ``torch`` as not importable in this process (``sys.modules["torch"]
= None``, Python's own marker for a module that must not load): ``importlib.util.find_spec``
then answers None, so ``transformers`` takes the machine for one without PyTorch, and an
``import torch`` raises ``ModuleNotFoundError``. The worker and the gateway call it first thing.
``KVSERVE_ALLOW_TORCH=1`` turns it off (a tokenizer whose own code, loaded with
``trust_remote_code``, needs PyTorch).
"""

from __future__ import annotations

import os
import sys

ENV = "KVSERVE_ALLOW_TORCH"


def keep_torch_out() -> bool:
    """Make ``torch`` unimportable in this process; False where it is imported already or
    ``KVSERVE_ALLOW_TORCH=1``."""
    if os.environ.get(ENV, "") == "1" or sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True
