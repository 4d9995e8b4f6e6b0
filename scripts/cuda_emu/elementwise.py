"""``cupy.ElementwiseKernel`` on the CPU emulator, for the simple kernels the worker uses: named
element types (``"uint16 u"``; a type letter such as ``T`` takes the first input's dtype), no
``raw`` parameters, inputs of one shape (or scalars), outputs new or given, one thread per
element."""

from __future__ import annotations

import numpy as np

from scripts.cuda_emu.audit import active
from scripts.cuda_emu.module import RawModule, Unsupported

_C_TYPES = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short",
            "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
            "int64": "long long", "uint64": "unsigned long long", "float32": "float",
            "float64": "double"}
THREADS = 256


def _params(spec: str) -> list[tuple[str, str]]:
    out = []
    for p in filter(None, (s.strip() for s in spec.split(","))):
        words = p.split()
        if len(words) != 2 or words[0] == "raw":
            raise Unsupported(f"ElementwiseKernel parameter {p!r}: only 'type name' ones")
        out.append((words[0], words[1]))
    return out


class ElementwiseKernel:
    xp = None  # the fake cupy module (it sets this: no import circle)

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel",
                 reduce_dims: bool = True, preamble: str = "", options: tuple = (), **_kw):
        self.ins, self.outs = _params(in_params), _params(out_params)
        self.operation, self.name, self.preamble = operation, name, preamble
        self._modules: dict[tuple, RawModule] = {}

    def _dtype(self, t: str, generic: np.dtype) -> np.dtype:
        return np.dtype(t) if t in _C_TYPES else generic

    def __call__(self, *args, size: int | None = None, **_kw):
        audit = active()
        if audit is None:
            return self._call(args)
        audit.launch(f"elementwise {self.name}")
        with audit.inner():
            return self._call(args)

    def _call(self, args: tuple):
        cp = self.xp
        n_in = len(self.ins)
        # a scalar argument travels by value (no host-to-device copy, frozen in a graph)
        ins = [a if isinstance(a, cp.ndarray) else cp.ndarray._of(np.asarray(a))
               for a in args[:n_in]]
        generic = ins[0].dtype if ins else np.dtype(np.float32)
        shape = next((a.shape for a in ins if a.ndim), ())
        ins = [cp.ascontiguousarray(cp.broadcast_to(a, shape), dtype=self._dtype(t, generic))
               for a, (t, _) in zip(ins, self.ins, strict=True)]
        outs = list(args[n_in:]) or [cp.empty(shape, self._dtype(t, generic)) for t, _ in self.outs]
        types = tuple(np.dtype(a.dtype).name for a in ins + outs)
        if types not in self._modules:
            self._modules[types] = RawModule(code=self._source(types), options=("--fmad=false",))
        n = int(np.prod(shape))
        if n:
            fn = self._modules[types].get_function(self.name)
            fn((-(-n // THREADS),), (THREADS,), (*ins, *outs, np.int64(n)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _source(self, types: tuple) -> str:
        params = self.ins + self.outs
        c = [_C_TYPES[t] for t in types]
        n_in = len(self.ins)
        sig = ", ".join(f"{'const ' if i < n_in else ''}{c[i]}* p_{nm}"
                        for i, (_, nm) in enumerate(params))
        loads = "".join(f"{c[i]} {nm} = p_{nm}[i]; " for i, (_, nm) in enumerate(self.ins))
        decl = "".join(f"{c[n_in + j]} {nm}; " for j, (_, nm) in enumerate(self.outs))
        store = "".join(f"p_{nm}[i] = {nm}; " for _, nm in self.outs)
        return (f"{self.preamble}\nextern \"C\" __global__ void {self.name}({sig}, long long n) "
                f"{{\n long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                f" if (i >= n) return;\n {loads}{decl}\n {self.operation};\n {store}\n}}\n")
