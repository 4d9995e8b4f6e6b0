"""CUDA graphs on the emulator: stream capture as a record of launches, replay as running the
record again.

A real capture runs nothing: every kernel (and every memset or copy between device arrays)
becomes a node with its arguments as they were at capture (pointers and scalars), and a
replay runs the nodes over whatever the memory holds then. So a value the host worked out at
capture (a row count, a segment's length, a slot's position passed as a scalar) is frozen
into the graph, and a replay for another batch uses it again. Re-running the captured Python
function instead, as a stand-in, would work those values out anew and hide exactly that
mistake. Here:

* ``Stream.begin_capture`` (scripts/cuda_emu/fake_cuda.py) starts a :class:`Capture`; every
  device operation of the fake CuPy (fake_cupy.py), every raw-kernel launch (module.py) runs
  as usual (the capture needs its results' shapes) and is recorded: a kernel with its
  argument bytes, an array operation as a function over the same operand arrays that
  writes its result into the array the capture returned.
* Memory a recorded operation writes in place (a kernel's array arguments, ``a[...] = b``,
  ``out=``) is copied before the first write and put back by ``end_capture``: after a
  capture the device holds what it held before, as after a real one.
* A driver-API launch (``cupy.cuda.driver.launchKernel``: the pinned ring's kernels, which
  ring the CPU workers) is recorded and not run, as on a GPU: its raw pointers name no array
  whose memory the capture could put back (module.Function.launch_params).
* What a real capture refuses raises :class:`CaptureError`: a device-to-host copy or any
  other wait for the device, and a host-to-device copy (pageable host memory).
* :meth:`Graph.launch` runs the record in order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class CaptureError(RuntimeError):
    """An operation a CUDA stream capture does not permit (CUDA's
    cudaErrorStreamCaptureUnsupported / ...Implicit): the capture fails."""


class Capture:
    """One stream capture in progress: the record and the memory to put back."""

    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self._saved: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.failed: str | None = None

    def save(self, arrays) -> None:
        """Copy the whole memory behind each NumPy array of ``arrays`` (its root buffer)
        unless copied already in this capture."""
        for a in arrays:
            root = _root(a)
            if id(root) not in self._saved and root.flags.writeable:
                self._saved[id(root)] = (root, root.copy())

    def restore(self) -> None:
        for root, copy in reversed(list(self._saved.values())):
            root[...] = copy
        self._saved.clear()

    def refuse(self, what: str) -> None:
        """An operation a real capture refuses: the capture is invalidated and this raises."""
        self.failed = self.failed or what
        raise CaptureError(f"operation not permitted when stream is capturing: {what}")


_CAPTURE: Capture | None = None


def capturing() -> Capture | None:
    return _CAPTURE


def begin() -> None:
    global _CAPTURE
    if _CAPTURE is not None:
        raise CaptureError("a stream is capturing already")
    _CAPTURE = Capture()


def end() -> Graph:
    """Stop the capture, put the memory back; the graph, or CaptureError if an operation
    was refused during it (CUDA invalidates such a capture)."""
    global _CAPTURE
    cap, _CAPTURE = _CAPTURE, None
    if cap is None:
        raise CaptureError("end_capture without begin_capture")
    cap.restore()
    if cap.failed:
        raise CaptureError(f"capture invalidated by: {cap.failed}")
    return Graph(cap.ops)


def record(compute: Callable[[], object], result: object) -> None:
    """While capturing: replay ``compute()`` (a function of device arrays) and copy what it
    returns into ``result`` (what it returned at capture), array by array."""
    if _CAPTURE is None:
        return
    targets = _arrays(result)

    def replay() -> None:
        for dst, src in zip(targets, _arrays(compute()), strict=True):
            if dst is not src and dst.flags.writeable:
                if dst.shape != src.shape:
                    raise CaptureError(f"a replay made a {src.shape} array where the capture "
                                       f"made {dst.shape} (a shape that depends on values)")
                dst[...] = src

    _CAPTURE.ops.append(replay)


def record_launch(launch: Callable[[], None], keep: tuple) -> None:
    """While capturing: a kernel launch, replayed as it is (``keep``: what its argument
    pointers point into, kept alive with the graph)."""
    if _CAPTURE is not None:
        _CAPTURE.ops.append(lambda: (launch(), keep)[0])


class Graph:
    """A captured graph: ``launch`` runs its record."""

    def __init__(self, ops: list[Callable[[], None]]) -> None:
        self.ops = ops

    def launch(self, stream=None) -> None:
        if _CAPTURE is not None:
            raise CaptureError("a graph launched while a stream is capturing")
        for op in self.ops:
            op()

    def upload(self, stream=None) -> None:
        pass


def _root(a: np.ndarray) -> np.ndarray:
    """The outermost NumPy array ``a`` views (itself when it views foreign memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _arrays(v) -> list[np.ndarray]:
    """The NumPy arrays behind a result: a device array, a tuple or list of them, or none."""
    a = getattr(v, "_a", v)
    if isinstance(a, np.ndarray):
        return [a]
    if isinstance(v, (tuple, list)):
        return [x for part in v for x in _arrays(part)]
    return []
