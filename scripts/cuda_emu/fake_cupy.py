"""Enough of CuPy for kernel-level GPU tests on the CPU (installed as ``cupy`` by
:func:`scripts.cuda_emu.plugin.install`): arrays are NumPy arrays in a wrapper that is *not*
a ``numpy.ndarray`` (so ``isinstance(a, np.ndarray)`` and implicit conversion behave as with
CuPy: ``np.asarray(device_array)`` raises, ``.get()`` copies), every ``cupy.X`` function is
NumPy's on the unwrapped arrays, and ``RawModule`` / ``RawKernel`` / ``ElementwiseKernel``
compile their CUDA source for the CPU (scripts/cuda_emu/module.py). Stream capture records
every operation for a graph's replays (scripts/cuda_emu/graph.py: :func:`_do` and the raw
kernels' launches), and refuses what a real capture refuses (waits, host-to-device copies).

Not modelled: streams and events (no-ops; every launch has finished when it returns), memory
pools (nothing to free; ``cuda.MemoryPool`` and ``cuda.using_allocator`` exist and do
nothing), the driver API, cuBLAS-backed speed."""

from __future__ import annotations

import operator
import sys

import numpy as np

from scripts.cuda_emu.audit import active
from scripts.cuda_emu.elementwise import ElementwiseKernel
from scripts.cuda_emu.graph import capturing, record
from scripts.cuda_emu.module import RawKernel, RawModule

__all__ = ["ElementwiseKernel", "RawKernel", "RawModule", "asarray", "asnumpy", "cuda",
           "get_default_memory_pool", "get_default_pinned_memory_pool", "ndarray"]
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
        return _dev(np.asarray(v))
    if isinstance(v, tuple):
        return tuple(_dev(x) for x in v)
    if isinstance(v, list):
        return [_dev(x) for x in v]
    return v


def _do(name: str, compute, ins=(), always: bool = False, writes=()):
    """``compute()`` (device arrays in and out), recorded while a stream captures
    (scripts/cuda_emu/graph.py: a replay computes it again into the same result arrays;
    ``writes``: the arrays it changes in place, put back after the capture); audited as
    :func:`_launched`."""
    cap = capturing()
    if cap is not None and writes:
        cap.save(writes)
    res = compute()
    record(compute, res)
    return _launched(name, res, ins, always)


def _launched(name: str, res, ins=(), always: bool = False):
    """Record (auditing) ``name`` as a launch when it made new arrays (not views or its
    inputs ``ins``: they are allocations too) or wrote in place (``always``); -> ``res``."""
    a = active()
    if a is not None:
        fresh = _fresh(res, ins)
        if always or fresh:
            a.launch(name)
        for v in fresh:
            a.alloc(v.nbytes)
    return res


def _fresh(v, ins) -> list:
    if isinstance(v, ndarray):
        v = v._a
    if isinstance(v, np.ndarray):
        return [v] if v.flags.owndata and not any(v is x for x in ins) else []
    if isinstance(v, (tuple, list)):
        return [x for part in v for x in _fresh(part, ins)]
    return []


def _alloc(a: np.ndarray) -> np.ndarray:
    if active() is not None:
        active().alloc(a.nbytes)
    return a


def _sync(what: str) -> None:
    if capturing() is not None:
        capturing().refuse(f"wait for the device ({what})")
    if active() is not None:
        active().sync(what)


def _uploads(name: str, args) -> None:
    """Record (auditing) the host arrays among ``args`` as uploads of ``name``; a stream
    capture refuses them (a copy from pageable host memory)."""
    for v in args:
        if isinstance(v, (list, tuple)):
            _uploads(name, v)
        elif isinstance(v, np.ndarray) and v.ndim:
            what = f"{name}(host {v.dtype}{list(v.shape)})"
            if capturing() is not None:
                capturing().refuse(f"host-to-device copy {what}")
            if active() is not None:
                active().upload(what, v.nbytes)


def _ins(*vals) -> tuple:
    return tuple(v._a for v in vals if isinstance(v, ndarray))


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
        if active() is not None:
            active().alloc(self._a.nbytes)

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
        _sync(f"get {self._a.dtype}{list(self._a.shape)}")
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        _uploads("set", (arr,))
        self._a[...] = _host(arr, False)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_NO_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = tuple(_host(o, True) for o in kwargs["out"])
        args = tuple(_host(x, True) for x in inputs)
        return _do(f"{ufunc.__name__}.{method}" if method != "__call__" else ufunc.__name__,
                   lambda: _dev(getattr(ufunc, method)(*args, **kwargs)), _ins(*inputs),
                   "out" in kwargs, kwargs.get("out", ()))

    def __array_function__(self, func, types_, args, kwargs):
        a, k = _host(args, True), {n: _host(v, True) for n, v in kwargs.items()}
        return _do(func.__name__, lambda: _dev(func(*a, **k)), _ins(*args))

    def __getattr__(self, name):
        if name.startswith("__"):  # no __array_interface__ etc.: no implicit host copies
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if name in ("item", "tolist", "tobytes", *_SIZED):
            _sync(f"{name}() {self._a.dtype}{list(self._a.shape)}")
            if name not in _SIZED:
                return attr
        if callable(attr):
            inplace = name in ("fill", "sort", "put")
            return lambda *a, **k: _do(name, lambda: _dev(attr(
                *_host(a, True), **{n: _host(v, True) for n, v in k.items()})), (self._a,),
                inplace, (self._a,) if inplace else ())
        return _dev(attr) if isinstance(attr, np.ndarray) else attr

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        _uploads("index", keys)
        if any(isinstance(x, ndarray) and x._a.dtype == bool for x in keys):
            _sync("a boolean mask index's size")  # CuPy reads the count to size the result
        k = _host(key, False)
        return _do("getitem (gather)", lambda: _dev(self._a[k]), (self._a,))

    def __setitem__(self, key, value) -> None:
        _uploads("index", key if isinstance(key, tuple) else (key,))
        k, v = _host(key, False), _host(value, True)
        _do("setitem", lambda: self._a.__setitem__(k, v), always=True, writes=(self._a,))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (_dev(x) for x in self._a)

    def __repr__(self) -> str:
        return repr(self._a).replace("array(", "cupy.array(", 1)

    def __format__(self, spec: str) -> str:
        _sync("format")
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __bool__(self) -> bool:
        _sync("__bool__")
        return bool(self._a)

    def __int__(self) -> int:
        _sync("__int__")
        return int(self._a)

    def __float__(self) -> float:
        _sync("__float__")
        return float(self._a)

    def __index__(self) -> int:
        _sync("__index__")
        return operator.index(self._a.item())

    def __copy__(self):
        return _do("copy", lambda: _dev(self._a.copy()))

    def __neg__(self):
        return _do("negative", lambda: _dev(-self._a))

    def __pos__(self):
        return _do("positive", lambda: _dev(+self._a))

    def __abs__(self):
        return _do("absolute", lambda: _dev(abs(self._a)))

    def __invert__(self):
        return _do("invert", lambda: _dev(~self._a))


def _binary(name: str):
    def f(self, other):
        o = _host(other, True)
        return _do(name.strip("_"), lambda: _dev(getattr(self._a, name)(o)))

    f.__name__ = name
    return f


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
            "lshift", "rshift", "matmul", "eq", "ne", "lt", "le", "gt", "ge"):
    for _name in (f"__{_op}__", f"__r{_op}__"):
        if hasattr(np.ndarray, _name):
            setattr(ndarray, _name, _binary(_name))


def _inplace_keeps_identity(name: str):
    def f(self, other):
        o = _host(other, True)
        _do(name.strip("_"), lambda: getattr(self._a, name)(o), always=True, writes=(self._a,))
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
        return _do("astype", lambda: _dev(np.asarray(a._a, dtype=dtype, order=order)),
                   (a._a,))
    return _host_copy("asarray", np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order="K", ndmin=0, **_kw) -> ndarray:
    if isinstance(a, ndarray):
        return _do("array", lambda: _dev(np.array(a._a, dtype=dtype, copy=True, order=order,
                                                  ndmin=ndmin)), (a._a,))
    return _host_copy("array", np.array(_host(a, False), dtype=dtype, copy=True, order=order,
                                        ndmin=ndmin))


def _host_copy(name: str, host: np.ndarray) -> ndarray:
    """A host value copied to the device: audited as an upload, refused while capturing."""
    what = f"{name}(host {host.dtype}{list(host.shape)})"
    if capturing() is not None:
        capturing().refuse(f"host-to-device copy {what}")
    if active() is not None:
        active().upload(what, host.nbytes)
    return _dev(_alloc(host))


def ascontiguousarray(a, dtype=None) -> ndarray:
    dev = asarray(a)
    return _do("ascontiguousarray", lambda: _dev(np.ascontiguousarray(dev._a, dtype=dtype)),
               (dev._a,))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    if isinstance(a, ndarray):
        a_ = active()
        if a_ is not None:
            a_.sync(f"asnumpy {a._a.dtype}{list(a._a.shape)}")
            with a_.inner():
                return a.get(order=order, out=out)
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C") -> ndarray:
    return _dev(_alloc(_garbage(np.empty(shape, dtype, order=order))))


def empty_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return _dev(_alloc(_garbage(np.empty_like(_host(a, False), dtype=dtype, order=order,
                                              shape=shape))))


def get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def fuse(*args, **kwargs):
    return args[0] if args and callable(args[0]) else (lambda f: f)


# functions whose result's size depends on values: CuPy reads it from the device
_SIZED = ("nonzero", "flatnonzero", "argwhere", "unique", "extract", "compress")


def __getattr__(name: str):
    """Every other ``cupy.X``: NumPy's, device arrays in and out."""
    obj = getattr(np, name)
    if isinstance(obj, type) or not callable(obj):
        return obj

    def f(*a, **k):
        _uploads(name, (*a, *k.values()))
        if name in _SIZED:
            _sync(f"{name}'s result size")
        ha, hk = _host(a, False), {n: _host(v, False) for n, v in k.items()}
        return _do(name, lambda: _dev(obj(*ha, **hk)),
                   _ins(*a, *(x for v in a if isinstance(v, (list, tuple)) for x in v)),
                   writes=_outs(hk))

    f.__name__ = name
    return f


def _outs(kwargs: dict) -> tuple:
    """The arrays a NumPy function writes through ``out=``."""
    out = kwargs.get("out")
    return tuple(out) if isinstance(out, tuple) else (out,) if out is not None else ()


from scripts.cuda_emu.fake_cuda import (  # noqa: E402  (the cupy.cuda namespace, pools)
    cuda,
    get_default_memory_pool,
    get_default_pinned_memory_pool,
)

ElementwiseKernel.xp = sys.modules[__name__]
