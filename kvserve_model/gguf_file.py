"""A GGUF file's header read with the standard library: metadata, tensor table, where data is.

GGUF (llama.cpp's format, versions 2 and 3) is a little-endian header of typed key-value
metadata and a table of tensors (name, shape, ggml type, offset), then the tensors' bytes from an
aligned data section. This module reads the header only; :mod:`kvserve_model.gguf_convert` reads
the data it points at. Read here rather than through ``mx.load`` so that the gateway (no MLX)
can build the tokenizer from the metadata, and so a file with a tensor type we cannot convert is
refused by name before anything is loaded.

Shapes are given as numpy orders them (outermost first): GGUF lists dimensions innermost first
(``ne[0]`` is a row's length), so they are reversed here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import IO, Any

from kvserve_model.errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGMLType(IntEnum):
    """ggml's tensor types (ggml.h), those a GGUF file may name; which convert is
    :data:`kvserve_model.gguf_convert.CONVERTIBLE`'s to say."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


def type_name(code: int) -> str:
    try:
        return GGMLType(code).name
    except ValueError:
        return f"ggml type {code}"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first, as numpy orders it
    ggml_type: int
    offset: int  # from the start of the file

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata ``key``; ``{arch}`` in it stands for the architecture
        (``"{arch}.block_count"``)."""
        return self.metadata.get(key.format(arch=self.architecture), default)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts as GGUF does."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def read_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header; raises ModelLoadError on anything that is not GGUF v2/v3."""
    try:
        with open(path, "rb") as f:
            return _read(path, f)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e


def _read(path: Path, f: IO[bytes]) -> GGUFHeader:
    if f.read(4) != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    (version,) = struct.unpack("<I", f.read(4))
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
    r = _Reader(f)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.u32())
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        (n_dims,) = struct.unpack("<I", f.read(4))
        dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
        ggml_type, offset = struct.unpack("<IQ", f.read(12))
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = f.tell()
    start += -start % alignment
    tensors = {
        name: TensorInfo(name, shape, ggml_type, start + offset)
        for name, shape, ggml_type, offset in infos
    }
    return GGUFHeader(path, version, metadata, tensors)


class _Reader:
    """GGUF's typed values (gguf.md: "Standardized key-value pairs")."""

    SCALARS: dict[int, str] = {
        0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
        11: "<q", 12: "<d",
    }  # fmt: skip
    STRING, ARRAY = 8, 9

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f

    def u32(self) -> int:
        return int(struct.unpack("<I", self.f.read(4))[0])

    def string(self) -> str:
        (n,) = struct.unpack("<Q", self.f.read(8))
        return self.f.read(n).decode("utf-8", errors="surrogateescape")

    def value(self, kind: int) -> Any:
        if kind == self.STRING:
            return self.string()
        if kind == self.ARRAY:
            inner = self.u32()
            (n,) = struct.unpack("<Q", self.f.read(8))
            if inner in self.SCALARS:  # one read for the whole array: vocabularies are long
                fmt = self.SCALARS[inner]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{n}{fmt[1]}", self.f.read(size * n)))
            read: Callable[[], Any] = (
                self.string if inner == self.STRING else (lambda: self.value(inner))
            )
            return [read() for _ in range(n)]
        if kind not in self.SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        fmt = self.SCALARS[kind]
        return struct.unpack(fmt, self.f.read(struct.calcsize(fmt)))[0]
