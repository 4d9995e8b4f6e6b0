"""Every test here needs a CUDA device; without one (CI, laptops) they are skipped."""

from __future__ import annotations

import pytest


def _have_cuda() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver / no device
        return False


HAVE_CUDA = _have_cuda()


@pytest.fixture(autouse=True)
def _requires_cuda() -> None:
    if not HAVE_CUDA:
        pytest.skip("no CUDA device")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def bf16_model(request, tmp_path_factory):
    """A tiny bf16 model of each architecture on CuPy (seed 4), sized for the speculation
    tests' three slots (tests/unit/test_speculation.py)."""
    from gpu_worker.engine import Engine  # noqa: PLC0415
    from scripts.tiny_model import make_tiny_model  # noqa: PLC0415
    from tests.unit.test_speculation import CONTEXT, SLOTS  # noqa: PLC0415

    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=4,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="bfloat16", backend="cupy", max_slots=SLOTS,
                           max_len=CONTEXT).model


class _ReRun:
    """A captured graph's stand-in: a launch runs the captured function again and copies its
    outputs into the ones the capture returned (a graph writes the same buffers each time)."""

    def __init__(self, body, outs) -> None:
        self.body, self.outs = body, outs

    def launch(self, stream=None) -> None:
        for dst, src in zip(self.outs, self.body(), strict=True):
            if dst is not src:
                dst[...] = src


def _emulated_record(self, body):
    """StepGraphs._record on the emulator: run ``body`` (its static inputs hold this step),
    keep its outputs, then put the caches back as they were (capture runs nothing)."""
    caches = self.caches
    kept = [a for a in (caches.kv.k, caches.kv.v) if a is not None]
    if caches.states is not None:
        kept += [caches.states.conv, caches.states.rec]
    saved = [a.copy() for a in kept]
    outs = body()
    for a, old in zip(kept, saved, strict=True):
        a[...] = old
    return _ReRun(body, outs), outs


@pytest.fixture
def graph_stand_in(monkeypatch):
    """On the CPU emulator (scripts/cuda_emu, no CUDA graphs): StepGraphs captures by running
    the pass and replays by running it again, so tests of graph passes run there too (the
    host side: layouts, buckets, static inputs, shared buffers, counts); nothing on a GPU."""
    import cupy  # noqa: PLC0415

    from gpu_worker.step_graph import StepGraphs  # noqa: PLC0415

    if not hasattr(cupy.cuda.Stream, "begin_capture"):
        monkeypatch.setattr(StepGraphs, "_record", _emulated_record)
