"""Write a safetensors file with numpy alone: the generated and converted models' weights.

The format by hand (an 8-byte little-endian header length, a JSON header padded to 8 bytes, the
tensors' raw little-endian bytes in header order), with sorted names and keys, so the same
tensors give the same bytes whatever library versions are installed: a model's fingerprint (and
with it the cache service's pool registration) depends on them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy dtype -> safetensors dtype. bfloat16 has no numpy dtype: pass its bits as uint16 in a
# :class:`Raw` with dtype "BF16".
DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "int32": "I32",
    "int8": "I8",
}


class Raw:
    """A tensor given as its bits in ``array`` and the safetensors ``dtype`` they are (BF16)."""

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        self.array, self.dtype = array, dtype


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray | Raw]) -> None:
    import numpy as np

    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        t = tensors[name]
        array, dtype = (t.array, t.dtype) if isinstance(t, Raw) else (t, DTYPES[str(t.dtype)])
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        arrays[name] = array
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
