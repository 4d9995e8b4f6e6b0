"""The step audit (scripts/step_audit.py) on the CPU emulator's fake CuPy: the recorder sees
the launches of a real Runner step and the one device->host copy the step needs (the sampled
tokens, gpu_worker/verify.py), with its worker line; off, it records nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.cuda_emu.module import gxx

pytestmark = pytest.mark.skipif(gxx() is None, reason="no g++ for the CUDA emulator")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_cupy(monkeypatch):
    from scripts.cuda_emu import fake_cupy as fc  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "cupy", fc)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fc.cuda)
    return fc


def test_the_recorder_sees_syncs_uploads_launches_and_allocations(fake_cupy):
    from scripts.cuda_emu import audit  # noqa: PLC0415

    cp = fake_cupy
    x = cp.asarray(np.arange(6, dtype=np.float32))  # not recorded: no audit yet
    with audit() as a:
        y = cp.asarray(np.ones(6, np.float32))  # an upload
        z = x * y + 1  # two launches, two allocations
        z.reshape(2, 3)  # a view: no launch
        total = float(z.sum())  # a reduction launch, then a sync
        cp.asnumpy(z)
        cp.cuda.Stream.null.synchronize()
    assert total == 21.0
    whats = sorted(w.split()[0] for w, _ in a.syncs)
    assert whats == ["Stream.synchronize", "__float__", "asnumpy"], a.syncs
    assert a.num_launches == 3, a.launches
    assert sum(a.uploads.values()) == 1 and a.num_allocs >= 3, (a.uploads, a.allocs)
    sites = {site for _, site in a.syncs}
    assert any("test_step_audit.py" in s for s in sites), sites
    z + 1  # off: nothing recorded, no error
    assert a.num_launches == 3


# run in a process of its own: the worker's kernel modules keep what they compiled for the fake
PROBE = """
import json, sys
from scripts.step_audit import audit_steps, report
steps = audit_steps(sys.argv[1], slots=2, rows=3, kernels="all")
layers = steps.pop("layers")
print(json.dumps({name: {
    "report": report(name, a, rows, layers), "rows": rows, "launches": a.num_launches,
    "kinds": sorted(a.launches_by_kind()), "kernels": sorted({n for _, n in a.launches}),
    "syncs": [[w, s, n] for (w, s), n in a.syncs.items()],
    "uploads": [s for _, s in a.uploads], "allocs": a.num_allocs, "bytes": a.alloc_bytes}
    for name, (a, rows) in steps.items()}))
"""


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_a_runner_step_has_launches_and_the_sampled_tokens_copy(arch):
    res = subprocess.run([sys.executable, "-c", PROBE, arch], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = json.loads(res.stdout.strip().splitlines()[-1])
    for st in steps.values():
        text = st["report"]
        assert st["launches"] > 0, text
        assert {"attention", "moe", "sampling"} <= set(st["kinds"]), text
        assert {"sample_rows_f32", "match_drafts"} <= set(st["kernels"]), text
        assert any(k.startswith("paged_attn_f32_m") for k in st["kernels"]), text  # a variant
        tokens = [(w, n) for w, s, n in st["syncs"] if s.startswith("gpu_worker/verify.py")]
        assert len(tokens) == 1 and tokens[0][0].startswith("get int32"), text
        assert tokens[0][1] == 1, text
        assert any("sampler.py" in s for s in st["uploads"]), text
        assert st["allocs"] > 0 and st["bytes"] > 0, text
    assert steps["verify"]["rows"] == 2 * 3 and steps["decode"]["rows"] == 2
