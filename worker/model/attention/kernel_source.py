"""Kernel sources kept in files of their own beside the Python that launches them.

A source file (``paged_decode.cu``, ``paged_decode.metal``, ``paged_prefill.cu``) is a few named
pieces: a line ``// @section NAME`` starts one, which runs to the line before the next such
line (lines before the first are the file's own comment). The text is read once, at first use,
exactly as written: MLX keys its compiled kernels on the source.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_MARK = re.compile(r"^// @section (\w+)\n", re.MULTILINE)


@functools.cache
def sections(filename: str) -> dict[str, str]:
    """The named pieces of ``filename`` (in this package's folder)."""
    text = (Path(__file__).parent / filename).read_text()
    marks = list(_MARK.finditer(text))
    if not marks:
        raise ValueError(f"{filename} has no '// @section' lines")
    out = {}
    for m, nxt in zip(marks, [*marks[1:], None], strict=True):
        end = nxt.start() if nxt is not None else len(text)
        out[m.group(1)] = text[m.end() : end - 1]  # the newline before the next mark is not its
    return out
