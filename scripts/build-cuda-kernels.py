#!/usr/bin/env python3
"""Compiles cuda/kernels.cu ahead of time with NVRTC, for every architecture infer ships.

Writes cuda/build/kernels.sm_XX.cubin, the newest architecture's .ptx (embedded in the binary by
src/kernels/cuda/module.rs) and cuda/build/ptxas.txt (ptxas -v: registers, spills, shared memory
per kernel). NVRTC comes from the PyPI wheels (no CUDA toolkit or GPU needed):

    pip install nvidia-cuda-nvrtc-cu12==12.4.127 nvidia-cuda-runtime-cu12==12.4.127

Options: --check (compare with the committed files instead of writing; exit 1 on a difference),
--no-spills (exit 1 if ptxas reports spill stores or loads in any kernel). The NVRTC library and
the cuda_fp16.h headers are found in the installed wheels (or NVRTC_LIB / CUDA_INCLUDE).
Python and ctypes keep this dependency-free: the wheels are Python packages anyway, and the same
file runs in CI and on a developer machine.
"""
import ctypes
import glob
import os
import re
import sys

ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "cuda", "kernels.cu")
OUT = os.path.join(ROOT, "cuda", "build")


def find_wheel_dir(sub):
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    paths = list(spec.submodule_search_locations) if spec else []
    for p in paths:
        d = os.path.join(p, sub)
        if os.path.isdir(d):
            return d
    sys.exit(f"infer: nvidia/{sub} not found; install the NVRTC wheels (see this file's header)")


def load_nvrtc():
    lib = os.environ.get("NVRTC_LIB")
    if not lib:
        libs = sorted(glob.glob(os.path.join(find_wheel_dir("cuda_nvrtc/lib"), "libnvrtc.so*")))
        libs = [p for p in libs if "builtins" not in p]
        if not libs:
            sys.exit("infer: libnvrtc.so not found in the nvidia-cuda-nvrtc-cu12 wheel")
        lib = libs[0]
    return ctypes.CDLL(lib)


def compile_arch(nv, src, arch, include):
    prog = ctypes.c_void_p()
    check(nv, nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None))
    opts = [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        f"--include-path={os.path.join(ROOT, 'cuda')}",
        f"--include-path={include}",
        "--ptxas-options=-v",
    ]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"infer: NVRTC failed for {arch}:\n{log}")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(nv, nv.nvrtcGetPTX(prog, ptx))
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    check(nv, nv.nvrtcGetCUBIN(prog, cubin))
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.raw.rstrip(b"\0"), cubin.raw, log


def check(nv, rc):
    if rc != 0:
        nv.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"infer: NVRTC error {rc}: {nv.nvrtcGetErrorString(rc).decode()}")


def summarize(arch, log):
    """One line per kernel: registers, spill stores/loads, shared memory (from ptxas -v)."""
    rows, kernel = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel:
            smem = re.search(r"(\d+) bytes smem", line)
            rows.append((kernel, int(m.group(1)), spills, int(smem.group(1)) if smem else 0))
            kernel = None
    return [f"{arch} {k:<18} regs {r:>3}  spill st/ld {s[0]}/{s[1]}  smem {m}" for k, r, s, m in sorted(rows)]


def main():
    checking = "--check" in sys.argv
    nv = load_nvrtc()
    include = os.environ.get("CUDA_INCLUDE") or find_wheel_dir("cuda_runtime/include")
    src = open(SRC, "rb").read()
    outputs, report = {}, []
    for arch in ARCHS:
        ptx, cubin, log = compile_arch(nv, src, arch, include)
        # PTX only for the newest architecture: an older GPU always finds a cubin of its own
        # major version, and a newer one JIT-compiles the newest PTX (module.rs's `select`).
        if arch == ARCHS[-1]:
            outputs[f"kernels.{arch}.ptx"] = ptx
        outputs[f"kernels.{arch}.cubin"] = cubin
        report += summarize(arch, log)
    outputs["ptxas.txt"] = ("\n".join(report) + "\n").encode()
    spilled = [r for r in report if "spill st/ld 0/0" not in r]
    stale = []
    os.makedirs(OUT, exist_ok=True)
    for name, data in outputs.items():
        path = os.path.join(OUT, name)
        old = open(path, "rb").read() if os.path.exists(path) else None
        if old != data:
            stale.append(name)
            if not checking:
                open(path, "wb").write(data)
    print("\n".join(report))
    if checking and stale:
        sys.exit(f"infer: cuda/build is stale ({', '.join(stale)}); run scripts/build-cuda-kernels.py")
    if "--no-spills" in sys.argv and spilled:
        sys.exit("infer: ptxas reports register spills:\n" + "\n".join(spilled))


if __name__ == "__main__":
    main()
