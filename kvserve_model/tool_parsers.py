"""mlx-lm's tool-call parsers, loaded without MLX.

mlx-lm (0.32) gives each model a tool-call format when it loads its tokenizer
(``mlx_lm.tokenizer_utils.load``): the ``tool_parser_type`` of ``tokenizer_config.json``, else the
one ``_infer_tool_parser`` recognises in the chat template (or, failing that, the vocabulary). The
format is the module ``mlx_lm/tool_parsers/<name>.py``: the markers a call starts and ends with
(``tool_call_start``, ``tool_call_end``; an empty end runs to the end of the output) and
``parse_tool_call(text, tools)``, which turns the text between them into ``{"name", "arguments"}``
(or a list of them). mlx-lm is the maintained library for these formats, so the gateway uses its
code rather than a copy; but importing anything as ``mlx_lm.<module>`` runs ``mlx_lm/__init__``,
which imports MLX, and the gateway must not load MLX (docs/architecture.md, "Import rules").

So the files are loaded by path under names of ours, as ``kvserve_model.tokenizer`` loads mlx-lm's
Python chat templates: ``tokenizer_utils.py`` (it imports only ``transformers``) to call its
``_infer_tool_parser``, and the parser modules as submodules of a package registered here whose
path is mlx-lm's ``tool_parsers`` directory, so that their relative imports (``from .glm47
import ...``) resolve among themselves. What mlx-lm reads from a model module
(``TOKENIZER_DEFAULTS``, only ``muse_spark``'s in 0.32) needs the model code and is not read.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from kvserve_model.errors import ModelLoadError

PACKAGE = "kvserve_model._mlx_lm_tool_parsers"
TOKENIZER_UTILS = "kvserve_model._mlx_lm_tokenizer_utils"
_LOCK = threading.Lock()  # loading registers modules in sys.modules: one loader at a time


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One of mlx-lm's tool-call formats: ``start`` and ``end`` delimit a call in the model's
    text (``end`` empty: the call runs to the end of the output); ``parse(text, tools)`` is
    mlx-lm's ``parse_tool_call`` on the text between them: a dict with ``name`` and
    ``arguments`` (a list of them for formats with several calls in one segment); it raises
    (``ValueError`` and others) on text it cannot read."""

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


def tool_parser_for(hf: Any) -> ToolParser | None:
    """The tool-call format mlx-lm gives the ``transformers`` tokenizer ``hf``, or None (the
    model has none). Raises ModelLoadError when the tokenizer names a format mlx-lm lacks (mlx-lm
    itself would fail to load the model)."""
    name = (getattr(hf, "init_kwargs", None) or {}).get("tool_parser_type")
    if name is None:
        utils = _tokenizer_utils()
        name = utils._infer_tool_parser(hf) if utils is not None else None
    return None if name is None else load_tool_parser(str(name))


def load_tool_parser(name: str) -> ToolParser:
    """mlx-lm's format ``name`` (a module of ``mlx_lm/tool_parsers``). Raises ModelLoadError."""
    folder = _mlx_lm_dir()
    file = folder / "tool_parsers" / f"{name}.py" if folder is not None else None
    if not name.isidentifier() or file is None or not file.is_file():
        raise ModelLoadError(f"the tokenizer names tool parser {name!r}, which mlx-lm lacks")
    with _LOCK:
        _package(file.parent)
        module = importlib.import_module(f"{PACKAGE}.{name}")
    return ToolParser(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def _mlx_lm_dir() -> Path | None:
    """mlx-lm's package directory, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("mlx_lm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _package(folder: Path) -> ModuleType:
    """The package whose submodules are mlx-lm's parser files; nothing of mlx-lm's runs to make
    it (its ``__init__`` is not executed: a namespace-like package with that one directory)."""
    package = sys.modules.get(PACKAGE)
    if package is None:
        spec = ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
    return package


def _tokenizer_utils() -> ModuleType | None:
    """``mlx_lm/tokenizer_utils.py`` loaded from its file (None: mlx-lm is not installed)."""
    with _LOCK:
        module = sys.modules.get(TOKENIZER_UTILS)
        if module is not None:
            return module
        folder = _mlx_lm_dir()
        if folder is None or not (folder / "tokenizer_utils.py").is_file():
            return None
        spec = importlib.util.spec_from_file_location(
            TOKENIZER_UTILS, folder / "tokenizer_utils.py"
        )
        assert spec is not None and spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[TOKENIZER_UTILS] = module
        return module
