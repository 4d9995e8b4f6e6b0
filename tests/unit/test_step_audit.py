"""The step audit (scripts/step_audit.py) on the CPU emulator's fake CuPy: the recorder sees
the launches of a real Runner step and the one device->host copy the step needs (the sampled
tokens, gpu_worker/verify.py), with its worker line; off, it records nothing. A Gated
DeltaNet layer is five launches (a regression would be a launch back in the 80B's 36 layers)."""

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
    "uploads": [s for _, s in a.uploads], "allocs": a.num_allocs, "bytes": a.alloc_bytes,
    "gdn": sorted(n for (k, n), c in a.launches.items() if k == "gdn" for _ in range(c)),
    "gdn_layers": layers["gdn"]}
    for name, (a, rows) in steps.items()}))
"""


def _probe(arch: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, arch], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_a_runner_step_has_launches_and_the_sampled_tokens_copy(arch):
    steps = _probe(arch)
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


def test_a_gated_deltanet_layer_is_five_launches():
    """Decode and verify (drafts: tracked per-row states): the stacked input product, the conv,
    the recurrence with its gates, the gated RMSNorm and out_proj; no gates kernel, no
    separate norm or silu_mul."""
    for name, st in _probe("qwen3_next").items():
        gdn, layers = st["gdn"], st["gdn_layers"]
        assert layers >= 1 and len(gdn) == 5 * layers, (name, gdn, st["report"])
        products = [k for k in gdn if k.startswith("rowtile_")]
        assert sorted(set(gdn) - set(products)) == ["gated_rms_norm_rows", "gdn_conv",
                                                    "gdn_recurrent"], (name, gdn)
        assert len(products) == 2 * layers, (name, gdn)
