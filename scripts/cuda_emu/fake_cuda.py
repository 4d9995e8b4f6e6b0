"""``cupy.cuda`` of the fake CuPy: one device, streams and events that do nothing (every
emulated launch has finished when it returns), pinned memory as host buffers; stream capture
makes a graph whose launch runs the captured launches again (scripts/cuda_emu/graph.py)."""

from __future__ import annotations

import contextlib
import ctypes
import time
import types

from scripts.cuda_emu import graph
from scripts.cuda_emu.audit import active
from scripts.cuda_emu.module import Unsupported, launch_driver


def _synchronize(what: str):
    def synchronize(*_args) -> None:
        if graph.capturing() is not None:
            graph.capturing().refuse(what)
        if active() is not None:
            active().sync(what)

    return synchronize

_GIB = 1 << 30


class Stream:
    """A stream: launches run at once, so waiting and synchronising do nothing."""

    null = None
    ptr = 0

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def use(self) -> Stream:
        return self

    synchronize = _synchronize("Stream.synchronize")

    def wait_event(self, event) -> None:
        pass

    def record(self, event=None) -> Event:
        return event or Event()

    def done(self) -> bool:
        return True

    def begin_capture(self, mode=None) -> None:
        graph.begin()

    def end_capture(self) -> graph.Graph:
        return graph.end()

    def is_capturing(self) -> bool:
        return graph.capturing() is not None


Stream.null = Stream(null=True)


class Event:
    """An event: records the host time (get_elapsed_time gives wall time between two)."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.t = time.perf_counter()

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    synchronize = _synchronize("Event.synchronize")

    def query(self) -> bool:
        return True

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    return (end.t - start.t) * 1e3


class Device:
    def __init__(self, device: int = 0):
        self.id = device
        self.compute_capability = "90"

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def use(self) -> None:
        pass

    synchronize = _synchronize("Device.synchronize")

    @property
    def mem_info(self) -> tuple[int, int]:
        return 100 * _GIB, 140 * _GIB


def _pinned(nbytes: int):
    return (ctypes.c_char * max(1, nbytes))()  # supports the buffer protocol everywhere


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    memGetInfo=lambda: (100 * _GIB, 140 * _GIB),
    deviceGetAttribute=lambda attr, device=0: 1,
    deviceSynchronize=_synchronize("runtime.deviceSynchronize"),
    hostRegister=lambda ptr, size, flags=0: None,
    hostUnregister=lambda ptr: None,
    getDevice=lambda: 0,
    runtimeGetVersion=lambda: 13000,
    driverGetVersion=lambda: 13000,
    CUDARuntimeError=RuntimeError,
    streamCaptureModeGlobal=0,
    streamCaptureModeThreadLocal=1,
    streamCaptureModeRelaxed=2,
)


class MemoryPool:
    """A memory pool: the emulator's arrays are NumPy's, so there is nothing to allocate."""

    def malloc(self, size: int):
        raise Unsupported("the CUDA emulator allocates with NumPy, not through a pool")

    def free_all_blocks(self, stream=None) -> None:
        pass


class _Pool:
    """``cupy.get_default_memory_pool()`` and the pinned one: nothing is ever pooled."""

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


@contextlib.contextmanager
def using_allocator(allocator=None):
    """CuPy's allocator switch: a no-op (fake arrays never call an allocator)."""
    yield


cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=Device, runtime=runtime,
    get_current_stream=lambda device=None: Stream.null,
    get_elapsed_time=get_elapsed_time,
    alloc_pinned_memory=_pinned,
    driver=types.SimpleNamespace(launchKernel=launch_driver),
    is_available=lambda: True,
    Graph=graph.Graph,
    MemoryPool=MemoryPool,
    using_allocator=using_allocator,
)
