#!/usr/bin/env python3
"""Compile the device path's CUDA kernels with NVRTC, as poslab does at run time, on a machine
with no GPU: kernels.cu alone, then kernels.cu followed by flash/flash.cu (the fused attention's
program). A kernel written without a GPU fails here, not on a GPU's time.

    python3 scripts/gpu/nvrtc_check.py [LIBNVRTC]

LIBNVRTC defaults to the PyPI wheel nvidia-cuda-nvrtc (13.0, what the lent GPU machine runs),
installed into ~/.cache/poslab-nvrtc when it is missing. Prints each program's kernel count.
"""

import ctypes
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU = ROOT / "crates/poslab-kernels/src/gpu"
PROGRAMS = {
    "kernels.cu": ["kernels.cu"],
    "kernels.cu + flash/flash.cu": ["kernels.cu", "flash/flash.cu"],
}
WHEEL = "nvidia-cuda-nvrtc==13.0.88"


def library() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    target = pathlib.Path.home() / ".cache/poslab-nvrtc"
    lib = target / "nvidia/cu13/lib/libnvrtc.so.13"
    if not lib.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), WHEEL],
            check=True,
        )
    return str(lib)


def compile_program(nvrtc, name: str, files: list) -> int:
    source = "".join((GPU / f).read_text() for f in files).encode()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None) != 0:
        raise SystemExit(f"{name}: NVRTC could not create the program")
    # poslab compiles with cudarc's default options: none.
    status = nvrtc.nvrtcCompileProgram(prog, 0, None)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if status != 0:
        print(log.value.decode(), file=sys.stderr)
        raise SystemExit(f"{name}: NVRTC could not compile it (status {status})")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return sum(".entry" in line for line in ptx.value.decode().splitlines())


def main() -> None:
    lib = pathlib.Path(library())
    # NVRTC opens its builtins by name: loaded first from beside it, they are found.
    for builtins in sorted(lib.parent.glob("libnvrtc-builtins.so.*")):
        if "alt" not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(lib))
    for name, files in PROGRAMS.items():
        print(f"{name}: {compile_program(nvrtc, name, files)} kernels")


if __name__ == "__main__":
    main()
