"""Registers and spills of a CUDA source's kernels for sm_90, without a GPU: the source is
compiled to PTX by NVRTC (as CuPy does, with ``--fmad=false -ftz=true``), then ``ptxas -v``.
The two come from pip wheels, which need no driver:

    pip download --no-deps -d /tmp/w nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12
    mkdir /tmp/cuda && for w in /tmp/w/*.whl; do unzip -q -o "$w" -d /tmp/cuda; done
    python -c "from gpu_worker.kernels import paged_attention as pa; \\
               open('/tmp/pa.cu', 'w').write(pa._source())"
    python -m scripts.ptxas_report /tmp/pa.cu --cuda /tmp/cuda/nvidia --only paged_attn

A kernel at 255 registers with spill stores, or one whose registers halve its blocks per SM,
is slower on the device than its arithmetic says (docs/gpu_step.md).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

OPTIONS = (b"--gpu-architecture=compute_90", b"--fmad=false", b"-ftz=true", b"-std=c++17")


def ptx(source: str, nvrtc_lib: Path) -> str:
    """PTX of ``source`` from NVRTC (ctypes); raises with NVRTC's log when it does not compile."""
    lib = ctypes.CDLL(str(nvrtc_lib))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    rc = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    size = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode(errors="replace"))
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, out)
    return out.value.decode()


def report(ptx_text: str, ptxas: Path, tmp: Path) -> dict[str, str]:
    """Per kernel name, ptxas's register and spill lines for sm_90."""
    src = tmp / "k.ptx"
    src.write_text(ptx_text)
    out = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(src), "-o", str(tmp / "k.cubin")],
                         capture_output=True, text=True, check=True)
    return parse(out.stderr)


def parse(log: str) -> dict[str, str]:
    """``ptxas -v``'s log -> per kernel its register and spill lines, joined."""
    kernels: dict[str, str] = {}
    name = None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            name = line.split("'")[1]
            kernels[name] = ""
        elif name and ("Used" in line or "spill" in line):
            kernels[name] = (kernels[name] + " " + line.split(":", 1)[-1].strip()).strip()
    return kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a .cu file (a kernel module's source)")
    ap.add_argument("--cuda", type=Path, default=Path("/tmp/cuda/nvidia"),
                    help="the unpacked wheels' nvidia/ folder")
    ap.add_argument("--only", default="", help="kernels whose name contains this")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    args = ap.parse_args(argv)
    text = ptx(args.source.read_text(), args.cuda / "cuda_nvrtc" / "lib" / "libnvrtc.so.12")
    for name, line in report(text, args.cuda / "cuda_nvcc" / "bin" / "ptxas", args.tmp).items():
        if args.only in name:
            print(f"{name:40} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
