"""mlx-lm without ``transformers`` on the way to a loaded model.

Importing any part of ``mlx_lm`` runs its ``__init__``, which imports ``mlx_lm.utils`` and
``mlx_lm.generate``; both import ``transformers`` (for the tokenizer), and ``transformers``
imports PyTorch, sympy and scikit-learn where they are installed: 12.7 s of a 14.0 s worker
import on an H100 host (``python -X importtime``), before a single weight was read. The model
needs none of it: ``mlx_lm.models.*``, ``sample_utils`` and ``utils.load_model`` import only MLX
(and ``huggingface_hub``); only the tokenizer needs ``transformers``.

So the worker:

- registers ``mlx_lm`` as a package whose ``__init__`` runs on first use of a name it defines
  (``mlx_lm.load``, ``mlx_lm.generate``, ``__version__``), not on the import of a submodule
  (:func:`register_package`);
- imports ``mlx_lm.utils`` with ``mlx_lm.tokenizer_utils`` standing in for itself until a
  tokenizer is loaded (:func:`utils`): the stand-in's ``load`` imports the real module, points
  ``mlx_lm.utils`` at it and loads. Nothing else in ``mlx_lm.utils`` uses the module at import
  (``TokenizerWrapper`` appears in annotations only);
- loads the weights and runs its self-check on the main thread while a thread loads the
  tokenizer, ``transformers`` import and all (``worker.model.loader``). MLX releases the GIL in
  ``eval``, so the import runs beside the kernel compiles and the weight reads.

Best effort: where ``mlx_lm`` is already imported (a test process, a bench), both are no-ops and
the normal modules are used; the results are the same modules and functions either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types
from typing import Any

PACKAGE = "mlx_lm"
TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"
_lock = threading.RLock()  # the __init__ may ask the package for a name while it runs


class _LazyPackage(types.ModuleType):
    """``mlx_lm`` with its ``__init__`` deferred to the first name it is asked for."""

    def __getattr__(self, name: str) -> Any:
        # Only for names not set yet: submodules imported so far are attributes already.
        if name.startswith("__") and name not in ("__version__", "__all__"):
            raise AttributeError(name)
        with _lock:
            if not self.__dict__.get("_kvserve_initialized"):
                self.__dict__["_kvserve_initialized"] = True
                spec = self.__spec__
                assert spec is not None and spec.loader is not None
                spec.loader.exec_module(self)
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}") from None


def register_package() -> bool:
    """Register ``mlx_lm`` with its ``__init__`` deferred; False where it is imported already
    (or not installed: the first import then says so)."""
    if PACKAGE in sys.modules:
        return False
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations or spec.origin is None:
        return False
    package = _LazyPackage(PACKAGE)
    package.__spec__ = spec
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = PACKAGE
    package.__loader__ = spec.loader
    sys.modules[PACKAGE] = package
    return True


def utils() -> types.ModuleType:
    """``mlx_lm.utils``, imported (where it was not yet) without ``mlx_lm.tokenizer_utils``;
    where that import needs more of the module than the stand-in has (an mlx-lm newer than
    0.32), the plain import, transformers and all."""
    if "mlx_lm.utils" in sys.modules:
        return sys.modules["mlx_lm.utils"]
    if TOKENIZER_UTILS in sys.modules or not isinstance(sys.modules.get(PACKAGE), _LazyPackage):
        return importlib.import_module("mlx_lm.utils")
    stand_in = _tokenizer_stand_in()
    sys.modules[TOKENIZER_UTILS] = stand_in
    try:
        return importlib.import_module("mlx_lm.utils")
    except ImportError:
        sys.modules.pop("mlx_lm.utils", None)  # half-imported against the stand-in
    finally:
        if sys.modules.get(TOKENIZER_UTILS) is stand_in:
            del sys.modules[TOKENIZER_UTILS]
        package = sys.modules[PACKAGE]
        if package.__dict__.get("tokenizer_utils") is stand_in:
            del package.__dict__["tokenizer_utils"]
    return importlib.import_module("mlx_lm.utils")


def tokenizer_utils() -> types.ModuleType:
    """The real ``mlx_lm.tokenizer_utils`` (it imports ``transformers``), with ``mlx_lm.utils``
    pointed at it where it was imported with the stand-in."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx_lm's __init__ does
    real = importlib.import_module(TOKENIZER_UTILS)
    module = sys.modules.get("mlx_lm.utils")
    if module is not None and getattr(
        getattr(module, "_load_tokenizer", None), "_kvserve_stand_in", False
    ):
        setattr(module, "TokenizerWrapper", real.TokenizerWrapper)  # noqa: B010
        setattr(module, "_load_tokenizer", real.load)  # noqa: B010
    return real


def _tokenizer_stand_in() -> types.ModuleType:
    stand_in = types.ModuleType(TOKENIZER_UTILS)

    class TokenizerWrapper:  # annotations only, until the real module replaces it
        pass

    def load(*args: Any, **kwargs: Any) -> Any:
        return tokenizer_utils().load(*args, **kwargs)

    load._kvserve_stand_in = True  # type: ignore[attr-defined]
    stand_in.TokenizerWrapper = TokenizerWrapper  # type: ignore[attr-defined]
    stand_in.load = load  # type: ignore[attr-defined]
    return stand_in
