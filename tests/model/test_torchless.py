"""``kvserve_model.torchless``: the worker and the gateway load their tokenizers without
importing PyTorch where it is installed (``transformers`` imports it on a tokenizer's load, 12-15 s
on a GPU host). A stand-in ``torch`` package on the path records whether anything imported it;
each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve_model.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]

_LOAD = """
import json, sys
from pathlib import Path
if sys.argv[2] == "gateway":
    import gateway.__main__  # noqa: F401  (as `python -m gateway` starts)
    from kvserve_model.tokenizer import load_tokenizer
    ids = load_tokenizer(Path(sys.argv[1])).hf.encode("hello world")
else:
    import worker.__main__  # noqa: F401  (as `python -m worker` starts)
    from worker.model.loader import load_model
    ids = load_model(sys.argv[1]).tokenizer.encode("hello world")
from transformers.utils import is_torch_available
print(json.dumps({"ids": list(ids), "torch_available": is_torch_available()}))
"""


def _fake_torch(tmp_path: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    mark = tmp_path / "torch-imported"
    (site / "torch" / "__init__.py").write_text(
        "import os\n"
        "open(os.environ['FAKE_TORCH_MARK'], 'w').write('imported')\n"
        "__version__ = '2.0.0'\n"  # below what transformers takes: it goes no further
    )
    return site, mark


def _run(tmp_path: Path, process: str, allow: bool) -> tuple[dict, bool]:
    site, mark = _fake_torch(tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "FAKE_TORCH_MARK": str(mark),
    }
    env.pop("KVSERVE_ALLOW_TORCH", None)
    if allow:
        env["KVSERVE_ALLOW_TORCH"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(ensure_tiny_model()), process],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), mark.exists()


@pytest.mark.parametrize("process", ["worker", "gateway"])
def test_a_tokenizer_loads_without_importing_an_installed_torch(tmp_path, process):
    kept_out, imported = _run(tmp_path, process, allow=False)
    assert not imported
    assert kept_out["torch_available"] is False
    allowed, imported_when_allowed = _run(tmp_path / "allowed", process, allow=True)
    assert imported_when_allowed  # the stand-in is seen, so the first case could have failed
    assert kept_out["ids"] == allowed["ids"] and kept_out["ids"]
