"""CuPy's ``RawModule`` / ``RawKernel`` on the CPU: the CUDA source compiled with g++ against
``cuda_emu.h`` into a shared library (cached on disk by content), launched over NumPy memory.

Settings (environment): ``CUDA_EMU_FTZ`` (default 1: model ``-ftz=true``, which CuPy appends
to every compile), ``CUDA_EMU_TIMEOUT`` (seconds per launch, default 120), ``CUDA_EMU_CACHE``
(the build directory, default ``~/.cache/tandem/cuda_emu``), ``CUDA_EMU_CXX`` (default g++).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np

from scripts.cuda_emu.audit import active
from scripts.cuda_emu.graph import capturing, record_launch
from scripts.cuda_emu.ptx import translate_asm

HERE = Path(__file__).resolve().parent
DEFAULT_SHARED = 48 * 1024  # dynamic shared memory without the opt-in attribute
MAX_SHARED = 227 * 1024  # sm_90's opt-in maximum
_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_DYN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?"
                         r"([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;")
_ERRORS = {1: "DeadlockError", 2: "KernelFault", 3: "LaunchTimeout"}
_KINDS = ("pointer", "signed integer", "unsigned integer", "floating", "other")


class EmuError(RuntimeError):
    """A kernel the emulator could not compile or run to its end."""


class DeadlockError(EmuError):
    """No thread of a block can go on (a barrier some threads never reach)."""


class KernelFault(EmuError):
    """The kernel did something the device would not allow (misaligned load, bad mask)."""


class Unsupported(EmuError):
    """A CUDA feature the emulator does not model (listed in docs/gpu_step.md): the driver
    API, raw ElementwiseKernel parameters. Tests that need one are skipped (plugin.SKIP)."""


class LaunchTimeout(EmuError):
    """A launch ran longer than CUDA_EMU_TIMEOUT seconds (a spin that never ends?)."""


def gxx() -> str | None:
    """The C++ compiler the emulator uses, or None when there is none."""
    return shutil.which(os.environ.get("CUDA_EMU_CXX", "g++"))


def ftz_default() -> bool:
    return os.environ.get("CUDA_EMU_FTZ", "1") not in ("0", "", "false", "no")


def prepare(code: str) -> tuple[str, list[str]]:
    """(host C++ of the kernel source, its kernel names): dynamic shared arrays become
    pointers into the launch's buffer, PTX asm statements calls (line numbers kept)."""
    code = _DYN_SHARED.sub(lambda m: f"{m[1]}* {m[2]} = ({m[1]}*)emu::L.smem;", code)
    code = translate_asm(code)
    return code, list(dict.fromkeys(_KERNEL.findall(code)))


def _wrappers(names: list[str]) -> str:
    out = []
    for n in names:
        out.append(
            f'extern "C" int emu_launch_{n}(const unsigned* d, void** a, size_t s, int f, '
            f'double t, char* e, int el) {{ return emu::launch("{n}", &{n}, d, a, s, f, t, e, '
            f'el); }}\nextern "C" int emu_params_{n}(int* o, int m) '
            f'{{ return emu::params(&{n}, o, m); }}\n')
    return "".join(out)


def _cache_dir() -> Path:
    d = Path(os.environ.get("CUDA_EMU_CACHE", Path.home() / ".cache" / "tandem" / "cuda_emu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def build(code: str, options: tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """Compile ``code`` (CUDA C++) into a shared library -> (its path, kernel names)."""
    cxx = gxx()
    if cxx is None:
        raise EmuError("no C++ compiler for the CUDA emulator (set CUDA_EMU_CXX)")
    host, names = prepare(code)
    flags = [o for o in options if o.startswith(("-D", "-I", "-U"))]
    src = ('#include "cuda_emu.h"\n#line 1 "kernel.cu"\n' + host + "\n#line 1 \"emu_wrap\"\n"
           + _wrappers(names))
    headers = "".join((HERE / h).read_text() for h in ("cuda_emu.h", "cuda_emu_builtins.h"))
    key = hashlib.sha256("\0".join([src, headers, cxx, *flags]).encode()).hexdigest()[:20]
    so = _cache_dir() / f"k_{key}.so"
    if not so.exists():
        cpp = so.with_suffix(".cpp")
        cpp.write_text(src)
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC",
               "-shared", "-w", "-pthread", f"-I{HERE}", *flags, "-o", str(tmp), str(cpp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            lines = [ln for ln in res.stderr.splitlines() if "error" in ln][:15]
            raise EmuError("the kernel source does not compile on the host (" + " ".join(cmd)
                           + "):\n" + "\n".join(lines or res.stderr.splitlines()[:30]))
        os.replace(tmp, so)
    return so, names


def _scalar_bytes(a, size: int, kind: int, where: str) -> bytes:
    if isinstance(a, np.generic):
        ok = (a.dtype.kind == "f") == (kind == 3) and a.dtype.kind in "fiub" and kind != 0
        if not ok or a.dtype.itemsize != size:
            raise TypeError(f"{where}: a {a.dtype} for a {size}-byte {_KINDS[kind]} parameter")
        return a.tobytes()
    raise TypeError(f"{where}: {type(a).__name__} {a!r}; pass a NumPy scalar of the "
                    f"parameter's type (a Python number's size is CuPy's choice, not the "
                    f"parameter's)")


def device_pointer(a) -> int | None:
    """The data pointer of a fake-cupy array, None for anything else."""
    ptr = getattr(a, "__emu_ptr__", None)
    return ptr() if ptr is not None else None


class Function:
    """One kernel of a module: ``fn(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, module: RawModule, name: str):
        self.module, self.name = module, name
        lib = module.lib
        self._launch = getattr(lib, f"emu_launch_{name}")
        self._launch.restype = ctypes.c_int
        info = (ctypes.c_int * 512)()
        n = getattr(lib, f"emu_params_{name}")(info, 512)
        self.params = [(info[2 * i], info[2 * i + 1]) for i in range(n)]
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None,
                 enable_cooperative_groups: bool = False) -> None:
        audit = active()
        if audit is not None:
            audit.launch(self.name)
        grid, block = _dims(grid), _dims(block)
        where = f"kernel {self.name} grid {grid} block {block}"
        if np.prod(block) > 1024 or block[2] > 64 or min(grid + block) < 1 \
                or max(grid[1:]) > 65535:
            raise EmuError(f"{where}: invalid launch dimensions")
        if shared_mem > max(DEFAULT_SHARED, min(self.max_dynamic_shared_size_bytes, MAX_SHARED)):
            raise EmuError(f"{where}: {shared_mem} bytes of dynamic shared memory; over "
                           f"{DEFAULT_SHARED} needs max_dynamic_shared_size_bytes (at most "
                           f"{MAX_SHARED})")
        if len(args) != len(self.params):
            raise TypeError(f"{where}: {len(args)} arguments for {len(self.params)} parameters")
        keep = []
        for i, (a, (size, kind)) in enumerate(zip(args, self.params, strict=True)):
            ptr = device_pointer(a)
            if ptr is None and kind == 0:
                raise TypeError(f"{where}, argument {i}: {type(a).__name__} for a pointer "
                                f"parameter (a device array is needed; NumPy arrays are not)")
            if ptr is not None and kind != 0:
                raise TypeError(f"{where}, argument {i}: an array for a {_KINDS[kind]}")
            raw = ptr.to_bytes(8, "little") if ptr is not None else _scalar_bytes(
                a, size, kind, f"{where}, argument {i}")
            keep.append(ctypes.create_string_buffer(raw, max(len(raw), 8)))
        ptrs = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(b) for b in keep])
        dims = (ctypes.c_uint * 6)(*grid, *block)
        cap = capturing()
        if cap is not None:  # a graph node: these argument bytes at every replay
            cap.save([a._a for a in args if device_pointer(a) is not None])
            record_launch(lambda: self.module.run(self, dims, ptrs, shared_mem, where),
                          (args, keep))
        self.module.run(self, dims, ptrs, shared_mem, where)

    @property
    def ptr(self) -> int:
        """The handle ``cupy.cuda.driver.launchKernel`` takes (:func:`launch_driver`)."""
        _BY_HANDLE[id(self)] = self
        return id(self)

    def launch_params(self, grid, block, shared_mem: int, params: int) -> None:
        """``cuLaunchKernel``'s launch: ``params`` the address of an array of pointers to the
        arguments' values, each read now (its size from the kernel's signature), as the
        driver copies them. While a stream captures, the launch is recorded and *not* run,
        as on a GPU (raw pointers name no array whose memory the capture could put back;
        the pinned ring's kernels would ring the CPU workers): what the capture computes
        after it reads the output's memory as it was."""
        audit = active()
        if audit is not None:
            audit.launch(self.name)
        grid, block = _dims(grid), _dims(block)
        where = f"kernel {self.name} grid {grid} block {block} (driver API)"
        table = ctypes.cast(ctypes.c_void_p(params), ctypes.POINTER(ctypes.c_void_p))
        keep = [ctypes.create_string_buffer(ctypes.string_at(table[i], size), max(size, 8))
                for i, (size, _) in enumerate(self.params)]
        ptrs = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(b) for b in keep])
        dims = (ctypes.c_uint * 6)(*grid, *block)
        if capturing() is not None:
            record_launch(lambda: self.module.run(self, dims, ptrs, shared_mem, where), keep)
            return
        self.module.run(self, dims, ptrs, shared_mem, where)


_BY_HANDLE: dict[int, Function] = {}


def launch_driver(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                  shared_mem: int, stream: int, params: int, extra: int) -> None:
    """``cupy.cuda.driver.launchKernel`` of the fake CuPy, for a :attr:`Function.ptr`."""
    if f not in _BY_HANDLE or extra:
        raise Unsupported(f"launchKernel of handle {f} (extra {extra}): not an emulated kernel")
    _BY_HANDLE[f].launch_params((gx, gy, gz), (bx, by, bz), shared_mem, params)


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


class RawModule:
    """``cupy.RawModule(code=..., options=...)`` compiled for the CPU; ``ftz`` None: the
    CUDA_EMU_FTZ setting."""

    def __init__(self, code: str | None = None, *, path: str | None = None,
                 options: tuple[str, ...] = (), ftz: bool | None = None, **_ignored):
        if code is None:
            code = Path(path).read_text()
        options = tuple(options)
        if "--fmad=false" not in options and "-fmad=false" not in options:
            warnings.warn("CUDA emulator: compiled without --fmad=false, the device may fuse "
                          "multiply-adds that the CPU emulation keeps apart", stacklevel=2)
        self.path, self.names = build(code, options)
        self.lib = ctypes.CDLL(str(self.path))
        self.ftz = ftz_default() if ftz is None else ftz
        self._lock = threading.Lock()
        self._functions: dict[str, Function] = {}
        self._stuck = None

    def get_function(self, name: str) -> Function:
        if name not in self._functions:
            if name not in self.names:
                raise EmuError(f"no kernel {name!r} in the module (found {self.names})")
            self._functions[name] = Function(self, name)
        return self._functions[name]

    def run(self, fn: Function, dims, args, shared_mem: int, where: str) -> None:
        """One launch, in a helper thread so that a launch that never ends times out."""
        if self._stuck:
            raise EmuError(f"{where}: the module is unusable, {self._stuck} never ended")
        timeout = float(os.environ.get("CUDA_EMU_TIMEOUT", "120"))
        err = ctypes.create_string_buffer(4096)
        rc = []

        def go():
            rc.append(fn._launch(dims, args, ctypes.c_size_t(shared_mem), int(self.ftz),
                                 ctypes.c_double(timeout), err, 4096))

        with self._lock:
            t = threading.Thread(target=go, name=f"emu-{fn.name}", daemon=True)
            t.start()
            t.join(timeout + 5)
            if t.is_alive():
                self._stuck = where
                raise LaunchTimeout(f"{where}: no end after {timeout:.0f} s (a loop with no "
                                    f"barrier that never ends?)")
        if rc[0]:
            cls = {"DeadlockError": DeadlockError, "KernelFault": KernelFault,
                   "LaunchTimeout": LaunchTimeout}.get(_ERRORS.get(rc[0], ""), EmuError)
            raise cls(err.value.decode(errors="replace"))


class RawKernel(Function):
    """``cupy.RawKernel(code, name, options=...)`` compiled for the CPU."""

    def __init__(self, code: str, name: str, options: tuple[str, ...] = (), **kwargs):
        super().__init__(RawModule(code=code, options=options, **kwargs), name)
