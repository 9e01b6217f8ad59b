"""``worker.model.mlx_lm_light``: the worker imports mlx-lm's models and loads weights without
``transformers`` (most of a cold start on a host with PyTorch), and the tokenizer, loaded on its
own thread, is the one ``mlx_lm.load`` gives. Each case runs in a fresh interpreter: what a
process has imported is the thing under test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvserve_model.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_WORKER_IMPORT = """
import json, sys
import worker.__main__  # registers mlx_lm first, as `python -m worker` does
import worker.server
from worker.model.loader import load_model
before = "transformers" in sys.modules
loaded = load_model(sys.argv[1])
weights_only = "transformers" in sys.modules and not loaded.tokenizer_future.done()
tok = loaded.tokenizer
import mlx_lm
model, reference = mlx_lm.load(sys.argv[1])  # the package's __init__ runs on first use
text = "The capital of France is Paris. 123 \\u00e9t\\u00e9"
print(json.dumps({
    "transformers_at_import": before,
    "ids": tok.encode(text),
    "reference_ids": reference.encode(text),
    "eos": sorted(tok.eos_token_ids),
    "reference_eos": sorted(reference.eos_token_ids),
    "same_class": type(tok) is type(reference),
    "max_length": tok._tokenizer.model_max_length,
    "version": mlx_lm.__version__,
}))
"""


def test_the_worker_imports_without_transformers_and_its_tokenizer_is_mlx_lms():
    got = _run(_WORKER_IMPORT, str(ensure_tiny_model()))
    assert got["transformers_at_import"] is False
    assert got["ids"] == got["reference_ids"] and got["ids"]
    assert got["eos"] == got["reference_eos"]
    assert got["same_class"] is True
    assert got["max_length"] > 0
    assert got["version"]


_BROKEN_TOKENIZER = """
import json, sys
from worker.model import mlx_lm_light
mlx_lm_light.register_package()
from kvserve_model.errors import ModelLoadError
from worker.model.loader import load_model
loaded = load_model(sys.argv[1])
try:
    loaded.tokenizer
    print(json.dumps({"raised": None}))
except ModelLoadError as e:
    print(json.dumps({"raised": str(e)}))
"""


def test_a_tokenizer_that_fails_to_load_is_a_model_load_error(tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_model(), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (model / name).unlink(missing_ok=True)
    (model / "tokenizer.json").write_text("{not json")
    got = _run(_BROKEN_TOKENIZER, str(model))
    assert got["raised"] and "tokenizer" in got["raised"] and str(model) in got["raised"]


def test_already_imported_mlx_lm_is_left_as_it_is():
    got = _run(
        """
import json, sys
import mlx_lm
from worker.model import mlx_lm_light
registered = mlx_lm_light.register_package()
utils = mlx_lm_light.utils()
import mlx_lm.tokenizer_utils as real
print(json.dumps({"registered": registered, "same": utils._load_tokenizer is real.load}))
"""
    )
    assert got == {"registered": False, "same": True}


def test_an_mlx_lm_that_needs_more_of_its_tokenizer_module_is_imported_plainly():
    # The stand-in lacks what a newer mlx_lm.utils might import from tokenizer_utils: the import
    # falls back to the plain one (transformers and all) rather than failing the worker.
    got = _run(
        """
import json, sys, types
from worker.model import mlx_lm_light
mlx_lm_light.register_package()
real_stand_in = mlx_lm_light._tokenizer_stand_in
mlx_lm_light._tokenizer_stand_in = lambda: types.ModuleType(mlx_lm_light.TOKENIZER_UTILS)
utils = mlx_lm_light.utils()
import mlx_lm.tokenizer_utils as real
print(json.dumps({"transformers": "transformers" in sys.modules,
                  "same": utils._load_tokenizer is real.load,
                  "load_model": callable(utils.load_model)}))
"""
    )
    assert got == {"transformers": True, "same": True, "load_model": True}
