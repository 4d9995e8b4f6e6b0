"""CUDA graphs on the CPU emulator (scripts/cuda_emu/graph.py) behave as a GPU's: a replay
runs the captured launches over the memory as it is then, with the host values (kernel
scalars, Python numbers) frozen at capture; the capture leaves memory as it was; waits for
the device and host-to-device copies make the capture fail."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from scripts.cuda_emu.graph import CaptureError
from scripts.cuda_emu.module import gxx

pytestmark = pytest.mark.skipif(gxx() is None, reason="no g++ for the CUDA emulator")

_SCALE = r"""
extern "C" __global__ void scale_add(const float* x, float* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] + a * x[i];
}
"""


@pytest.fixture
def cp(monkeypatch):
    from scripts.cuda_emu import fake_cupy  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    return fake_cupy


def _capture(cp, body):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            out = body()
        finally:
            graph = stream.end_capture()
    return graph, out


def test_a_replay_reads_memory_then_and_host_values_of_the_capture(cp):
    fn = cp.RawModule(code=_SCALE, options=("--fmad=false",)).get_function("scale_add")
    x = cp.asarray(np.arange(8, dtype=np.float32))
    y = cp.zeros(8, cp.float32)
    host = {"a": 2.0, "k": 3.0}

    def body():
        fn((1,), (8,), (x, y, np.float32(host["a"]), np.int32(8)))  # y += a x, a frozen
        z = (x * host["k"]).astype(cp.float32)  # a fresh array, k frozen
        w = cp.empty(8, cp.float32)
        w[...] = z + y
        return w

    graph, w = _capture(cp, body)
    assert not y.get().any(), "the capture ran nothing: y as it was"
    host.update(a=100.0, k=100.0)  # a re-run of body would see these
    x[...] = cp.asarray(np.ones(8, np.float32))
    graph.launch()
    np.testing.assert_array_equal(y.get(), np.full(8, 2.0, np.float32))
    np.testing.assert_array_equal(w.get(), np.full(8, 3.0 + 2.0, np.float32))
    graph.launch()  # again: y accumulates, as the kernel does on a GPU
    np.testing.assert_array_equal(y.get(), np.full(8, 4.0, np.float32))
    np.testing.assert_array_equal(w.get(), np.full(8, 3.0 + 4.0, np.float32))


def test_a_capture_puts_back_what_it_wrote_in_place(cp):
    a = cp.asarray(np.arange(6, dtype=np.float32))
    view = a[2:4]

    def body():
        v = view
        v += 10
        a[0] = -1

    graph, _ = _capture(cp, body)
    np.testing.assert_array_equal(a.get(), np.arange(6, dtype=np.float32))
    graph.launch()
    np.testing.assert_array_equal(a.get(), [-1, 1, 12, 13, 4, 5])


@pytest.mark.parametrize("what", ["get", "upload", "item", "nonzero", "mask", "sync"])
def test_what_a_capture_refuses_fails_it(cp, what):
    a = cp.asarray(np.arange(4, dtype=np.int32))
    ops = {"get": lambda: a.get(), "upload": lambda: cp.asarray(np.ones(3)),
           "item": lambda: int(a[0]), "nonzero": lambda: cp.nonzero(a),
           "mask": lambda: a[a > 1], "sync": lambda: cp.cuda.Stream.null.synchronize()}
    stream = cp.cuda.Stream()
    stream.begin_capture()
    with pytest.raises(CaptureError, match="not permitted when stream is capturing"):
        ops[what]()
    with pytest.raises(CaptureError, match="invalidated"):
        stream.end_capture()
    a.get()  # no capture any more: allowed again


def test_array_operations_replay_into_the_arrays_the_capture_returned(cp):
    a = cp.asarray(np.arange(4, dtype=np.int64))

    def body():
        return cp.arange(4)[:2] + a[:2]

    graph, out = _capture(cp, body)
    a[...] = cp.asarray(np.full(4, 7, np.int64))
    graph.launch()
    np.testing.assert_array_equal(out.get(), [7, 8])


def test_a_driver_launch_copies_its_arguments_and_a_capture_only_records_it(cp):
    """``cupy.cuda.driver.launchKernel`` (the pinned ring's launches): the argument values are
    read at the launch, as the driver copies them; captured, it does not run (as on a GPU)
    and a replay runs it with the values of its launch, whatever the buffer holds later."""
    fn = cp.RawModule(code=_SCALE, options=("--fmad=false",)).get_function("scale_add")
    x = cp.asarray(np.arange(4, dtype=np.float32))
    y = cp.zeros(4, cp.float32)
    vals = np.zeros(4, np.int64)  # each argument 8 bytes; float and int read the low bytes
    params = np.arange(4, dtype=np.uint64) * 8 + np.uint64(vals.ctypes.data)

    def launch(a: float) -> None:
        vals[:] = (x.data.ptr, y.data.ptr, np.float32(a).view(np.int32), 4)
        cp.cuda.driver.launchKernel(fn.ptr, 1, 1, 1, 4, 1, 1, 0, 0, int(params.ctypes.data), 0)

    launch(1.0)
    np.testing.assert_array_equal(y.get(), [0, 1, 2, 3])
    graph, _ = _capture(cp, lambda: launch(10.0))
    np.testing.assert_array_equal(y.get(), [0, 1, 2, 3])  # not run
    launch(100.0)  # the buffer now holds 100
    graph.launch()
    np.testing.assert_array_equal(y.get(), [0, 111, 222, 333])
