"""Compile the block-table attention kernels with NVRTC on a machine without a GPU.

Device time is scarce; a kernel that does not compile, or that spills, costs a whole round trip
to find out. This wraps each kernel body the way ``mx.fast.cuda_kernel`` does (MLX's
``build_kernel``: the header, then a ``__global__`` function in ``mlx::core::cu`` with the
inputs, their ``_shape`` arguments where the body reads them, the outputs, and the template
arguments as ``constexpr`` / ``using``), with a stand-in for MLX's device header, and compiles
it for an sm_90 GPU with ``ptxas -v``: errors, registers, shared memory and spills, per variant.

NVRTC and the CUDA headers come from NVIDIA's wheels, downloaded once into ``--cuda``
(PyPI; about 100 MB, not a dependency of kvserve)::

    pip download --no-deps -d /tmp/nvrtc nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 \\
        nvidia-cuda-cccl-cu12 && (cd /tmp/nvrtc && for w in *.whl; do unzip -qo $w; done)
    .venv/bin/python scripts/nvrtc_kernels.py --cuda /tmp/nvrtc

It checks that the code compiles and what it costs; only a GPU checks what it computes
(``bench/gpu/check_attention.py``, ``tests/worker/test_gpu_attention.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from worker.model.attention import gpu_decode, gpu_prefill

# What MLX's device header gives a kernel body that these use: half types and a shape type.
PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
struct Shape { int v[10]; __device__ int operator[](int i) const { return v[i]; } };
"""
CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
INT_INPUTS = {"tables", "ends", "q_lens"}


def wrap(header: str, body: str, inputs: list[str], outputs: list[str], template: list) -> str:
    """The source MLX would compile for this kernel (``custom_kernel.cpp``'s ``build_kernel``)."""
    dtype = next(v for k, v in template if k == "T")

    def ctype(name: str) -> str:
        if name in INT_INPUTS:
            return "int"
        if name in ("params", "o_part", "ml_part"):
            return "float"
        return CUDA_TYPES[dtype]

    args = []
    for name in inputs:
        args.append(f"const {ctype(name)}* {name}")
        if f"{name}_shape" in body:
            args.append(f"const __grid_constant__ Shape {name}_shape")
    args += [f"{ctype(name)}* {name}" for name in outputs]
    consts = "".join(
        f"  using {k} = {CUDA_TYPES[v]};\n"
        if isinstance(v, mx.Dtype)
        else f"  constexpr int {k} = {v};\n"
        for k, v in template
    )
    return (
        PRELUDE
        + header
        + "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + "__global__ void kernel(\n    "
        + ",\n    ".join(args)
        + ") {\n"
        + consts
        + body
        + "\n}\n}\n"
    )


class Nvrtc:
    def __init__(self, root: Path, arch: str) -> None:
        self.lib = ctypes.CDLL(str(root / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
        self.opts = [
            f"--gpu-architecture={arch}",
            "--ptxas-options=--verbose",
            "-std=c++17",
            f"-I{root / 'nvidia/cuda_runtime/include'}",
            f"-I{root / 'nvidia/cuda_cccl/include'}",
        ]

    def compile(self, src: str) -> tuple[bool, str]:
        prog = ctypes.c_void_p()
        self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
        opts = (ctypes.c_char_p * len(self.opts))(*[o.encode() for o in self.opts])
        rc = self.lib.nvrtcCompileProgram(prog, len(self.opts), opts)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log.value.decode()


def variants() -> list[tuple[str, str, str, list[str], list[str], list]]:
    """(label, header, body, inputs, outputs, template) of each kernel variant worth a look."""
    out = []
    for dtype in (mx.float16, mx.bfloat16):
        for d, rep in ((64, 8), (64, 1), (128, 4)):
            nw, st = gpu_decode.tc_pipeline(d)
            for kind in ("single", "partial"):
                header, body = gpu_decode.render("cuda", kind, tc=True)
                template = [("T", dtype), ("D", d), ("REP", rep), ("RT", gpu_decode.TC_ROWS),
                            ("BS", 32), ("NW", nw), ("ST", st)]  # fmt: skip
                out.append((f"decode tc {kind} {dtype} D{d} GQA{rep} {nw}w x {st}st", header, body,
                            gpu_decode._INPUTS[kind], gpu_decode._OUTPUTS[kind], template))  # fmt: skip
    for dtype in (mx.float16, mx.float32):
        for d, rep in ((64, 8), (128, 4)):
            rt = gpu_decode.rows_per_tile(rep, 1)
            header, body = gpu_decode.render("cuda", "partial")
            template = [("T", dtype), ("D", d), ("REP", rep), ("RT", rt), ("BS", 32),
                        ("NW", gpu_decode.WARPS)]  # fmt: skip
            out.append((f"decode core partial {dtype} D{d} GQA{rep}", header, body,
                        gpu_decode._INPUTS["partial"], gpu_decode._OUTPUTS["partial"], template))  # fmt: skip
    for d in gpu_prefill.HEAD_DIMS:
        header, body = gpu_prefill.render("partial")
        template = [("T", mx.float16), ("D", d), ("REP", 4), ("BS", 32)]
        out.append((f"prefill partial float16 D{d}", header, body, gpu_prefill._INPUTS,
                    gpu_prefill._OUTPUTS["partial"], template))  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuda", type=Path, default=Path("/tmp/nvrtc"), help="the unpacked wheels")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    nvrtc = Nvrtc(args.cuda, args.arch)
    ok = True
    for label, header, body, inputs, outputs, template in variants():
        label = label.replace("mlx.core.", "")
        good, log = nvrtc.compile(wrap(header, body, inputs, outputs, template))
        ok &= good
        info = "; ".join(
            " ".join(ln.replace("ptxas info", "").replace("ptxas", "").split()).strip(" .:")
            for ln in log.splitlines()
            if "Used" in ln or "spill" in ln
        )
        print(f"{'ok  ' if good else 'FAIL'} {label}: {info if good else log.strip()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
