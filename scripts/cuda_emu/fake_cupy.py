"""Enough of CuPy for kernel-level GPU tests on the CPU (installed as ``cupy`` by
:func:`scripts.cuda_emu.plugin.install`): arrays are NumPy arrays in a wrapper that is *not*
a ``numpy.ndarray`` (so ``isinstance(a, np.ndarray)`` and implicit conversion behave as with
CuPy: ``np.asarray(device_array)`` raises, ``.get()`` copies), every ``cupy.X`` function is
NumPy's on the unwrapped arrays, and ``RawModule`` / ``RawKernel`` / ``ElementwiseKernel``
compile their CUDA source for the CPU (scripts/cuda_emu/module.py).

Not modelled: streams and events (no-ops; every launch has finished when it returns), memory
pools (nothing to free), the driver API, CUDA graphs, cuBLAS-backed speed."""

from __future__ import annotations

import operator
import sys

import numpy as np

from scripts.cuda_emu.elementwise import ElementwiseKernel
from scripts.cuda_emu.module import RawKernel, RawModule

__all__ = ["ElementwiseKernel", "RawKernel", "RawModule", "asarray", "asnumpy", "cuda",
           "ndarray"]
__version__ = "14.0.0-cpu-emulator"
_NO_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                "construct a NumPy array explicitly.")


def _host(v, strict: bool):
    """The NumPy value behind ``v`` (recursively in lists and tuples); ``strict``: a host
    array operand is refused, as CuPy refuses it."""
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, (list, tuple)):
        return type(v)(_host(x, strict) for x in v)
    if strict and isinstance(v, np.ndarray) and v.ndim:
        raise TypeError(f"Unsupported type {type(v)} (a host array mixed with device arrays)")
    return v


def _dev(v):
    """NumPy results as device arrays (0-d for reductions, as CuPy returns them)."""
    if isinstance(v, np.ndarray):
        return ndarray._of(v)
    if isinstance(v, np.generic) and not isinstance(v, (np.str_, np.bytes_, np.void)):
        return ndarray._of(np.asarray(v))
    if isinstance(v, tuple):
        return tuple(_dev(x) for x in v)
    if isinstance(v, list):
        return [_dev(x) for x in v]
    return v


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray:  # noqa: N801 (CuPy's name)
    """A device array: a NumPy array behind a wrapper with CuPy's interface."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100.0
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = _garbage(np.empty(shape, dtype, order=order))

    @classmethod
    def _of(cls, a: np.ndarray) -> ndarray:
        obj = cls.__new__(cls)
        obj._a = a
        return obj

    def __emu_ptr__(self) -> int:
        return self._a.__array_interface__["data"][0]

    @property
    def data(self) -> _Pointer:
        return _Pointer(self.__emu_ptr__())

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        self._a[...] = _host(arr, False)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_NO_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = tuple(_host(o, True) for o in kwargs["out"])
        res = getattr(ufunc, method)(*(_host(x, True) for x in inputs), **kwargs)
        return _dev(res)

    def __array_function__(self, func, types_, args, kwargs):
        return _dev(func(*_host(args, True), **{k: _host(v, True) for k, v in kwargs.items()}))

    def __getattr__(self, name):
        if name.startswith("__"):  # no __array_interface__ etc.: no implicit host copies
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if name in ("item", "tolist", "tobytes"):
            return attr
        if callable(attr):
            return lambda *a, **k: _dev(attr(*_host(a, True),
                                             **{n: _host(v, True) for n, v in k.items()}))
        return _dev(attr) if isinstance(attr, np.ndarray) else attr

    def __getitem__(self, key):
        return _dev(self._a[_host(key, False)])

    def __setitem__(self, key, value) -> None:
        self._a[_host(key, False)] = _host(value, True)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (_dev(x) for x in self._a)

    def __repr__(self) -> str:
        return repr(self._a).replace("array(", "cupy.array(", 1)

    def __format__(self, spec: str) -> str:
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __index__(self) -> int:
        return operator.index(self._a.item())

    def __copy__(self):
        return _dev(self._a.copy())

    def __neg__(self):
        return _dev(-self._a)

    def __pos__(self):
        return _dev(+self._a)

    def __abs__(self):
        return _dev(abs(self._a))

    def __invert__(self):
        return _dev(~self._a)


def _binary(name: str):
    def f(self, other):
        return _dev(getattr(self._a, name)(_host(other, True)))

    f.__name__ = name
    return f


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
            "lshift", "rshift", "matmul", "eq", "ne", "lt", "le", "gt", "ge"):
    for _name in (f"__{_op}__", f"__r{_op}__"):
        if hasattr(np.ndarray, _name):
            setattr(ndarray, _name, _binary(_name))


def _inplace_keeps_identity(name: str):
    def f(self, other):
        getattr(self._a, name)(_host(other, True))
        return self

    return f


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
            "lshift", "rshift"):
    setattr(ndarray, f"__i{_op}__", _inplace_keeps_identity(f"__i{_op}__"))


def _garbage(a: np.ndarray) -> np.ndarray:
    """Uninitialised device memory: NaN for floats, 0xA5 bytes otherwise (never zeros)."""
    if a.dtype.kind in "fc":
        a.fill(np.nan)
    else:
        a.view(np.uint8).reshape(-1)[:] = 0xA5
    return a


def asarray(a, dtype=None, order=None, *, blocking=False) -> ndarray:
    """Device array of ``a``: the same memory for a device array of the dtype, else a copy
    (host memory is never shared with the device)."""
    if isinstance(a, ndarray):
        return _dev(np.asarray(a._a, dtype=dtype, order=order))
    return _dev(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order="K", ndmin=0, **_kw) -> ndarray:
    return _dev(np.array(_host(a, False), dtype=dtype, copy=True, order=order, ndmin=ndmin))


def ascontiguousarray(a, dtype=None) -> ndarray:
    return _dev(np.ascontiguousarray(asarray(a)._a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C") -> ndarray:
    return _dev(_garbage(np.empty(shape, dtype, order=order)))


def empty_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return _dev(_garbage(np.empty_like(_host(a, False), dtype=dtype, order=order, shape=shape)))


def get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


class _Pool:
    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        pass

    def set_limit(self, size=None, fraction=None) -> None:
        pass

    def get_limit(self) -> int:
        return 0


def get_default_memory_pool() -> _Pool:
    return _POOL


def get_default_pinned_memory_pool() -> _Pool:
    return _POOL


_POOL = _Pool()


def fuse(*args, **kwargs):
    return args[0] if args and callable(args[0]) else (lambda f: f)


def __getattr__(name: str):
    """Every other ``cupy.X``: NumPy's, device arrays in and out."""
    obj = getattr(np, name)
    if isinstance(obj, type) or not callable(obj):
        return obj

    def f(*a, **k):
        return _dev(obj(*_host(a, False), **{n: _host(v, False) for n, v in k.items()}))

    f.__name__ = name
    return f


from scripts.cuda_emu.fake_cuda import cuda  # noqa: E402  (the cupy.cuda namespace)

ElementwiseKernel.xp = sys.modules[__name__]
