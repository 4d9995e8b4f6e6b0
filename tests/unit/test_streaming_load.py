"""Streaming placement at load (gpu_worker/weights/stream.py): the same model as the old
all-at-once load, each expert row read once to where it lives, any WeightSource, one log
line per phase, and peak host RSS within the resident bytes plus a bounded working set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_experts.pool import CpuExpertPool
from gpu_worker.engine import Engine, load_model
from gpu_worker.expert_stats import count_routing, hot_order, save_counts
from gpu_worker.experts.placement import ExpertPlacement
from gpu_worker.experts.split import split_from_orders
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.weights import stream
from gpu_worker.weights.checkpoint import CheckpointSource
from gpu_worker.weights.stream import resident_bytes
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

PROMPT = np.arange(5, 45) * 7 % 500
KEYS = ("gate_proj", "up_proj", "down_proj")


def _logits(model: Model, experts=None, prompt=PROMPT) -> np.ndarray:
    caches = model.new_caches(1, 64)
    batch = RaggedBatch.build([(0, 0, np.asarray(prompt))])
    rows = np.arange(len(prompt))
    if experts is None:
        return model.forward(batch, caches, rows).logits
    return experts.run_step(lambda: model.forward(batch, caches, rows, experts)).logits


def _old_way(path: Path, n_cpu: int, counts=None) -> tuple[Model, ExpertPlacement]:
    """The pre-streaming load, step by step: every tensor in float32 on the host, the model
    built from all of them, experts renumbered in place, the CPU's quantized from the full
    stacks, then cut from the backend."""
    ckpt = load_checkpoint(path)
    cfg, tensors = ckpt.config, ckpt.tensors
    model = Model(cfg, tensors)
    E = cfg.num_experts
    layers, on_cpu = {}, {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_sparse(i):
            continue
        p = f"model.layers.{i}.mlp."
        order = hot_order(counts[i]) if counts is not None else np.arange(E)
        mlp = model.layers[i].mlp
        mlp["gate.weight"] = mlp["gate.weight"][order]
        stacks = [tensors[p + "experts." + k][order] for k in KEYS]
        layers[i] = tuple(s[E - n_cpu:] for s in stacks)
        for k, s in zip(KEYS, stacks, strict=True):
            mlp["experts." + k] = s[:E - n_cpu].copy()
        on_cpu[i] = np.arange(E) >= E - n_cpu
    pool = CpuExpertPool(layers, num_workers=1)
    return model, ExpertPlacement(model, on_cpu, pool)


class RecordingSource:
    """A WeightSource over another one that records every read: (name, experts or None)."""

    def __init__(self, inner) -> None:
        self.inner, self.config, self.path = inner, inner.config, None
        self.reads: list[tuple[str, tuple[int, ...] | None]] = []

    def shapes(self):
        return self.inner.shapes()

    def nbytes(self, name: str) -> int:
        return self.inner.nbytes(name)

    def read(self, name, dtype, *, experts=None):
        self.reads.append((name, None if experts is None else tuple(int(e) for e in experts)))
        return self.inner.read(name, dtype, experts=experts)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_moe", seed=3, tokenizer=False,
                           moe_intermediate=64, dtype="bfloat16", shards=3)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_gpu_placement_equals_the_full_load(tmp_path, arch):
    path = make_tiny_model(tmp_path, arch, seed=5, tokenizer=False, shards=2,
                           expert_layout="fused", tie_embeddings=arch == "qwen3_moe")
    ckpt = load_checkpoint(path, dtype=np.float64)
    want = Model(ckpt.config, ckpt.tensors, dtype=np.float64, exact=True)
    got, experts = load_model(path, dtype="float64")
    assert experts is None
    assert got.mtp is not None or arch == "qwen3_moe"
    np.testing.assert_array_equal(_logits(got), _logits(want))
    assert resident_bytes(got) == resident_bytes(want)


def test_split_with_hot_experts_equals_the_old_way(moe, tmp_path, monkeypatch):
    # one thread: the reads come in run order
    monkeypatch.setattr(stream, "default_threads", lambda: 1)
    ckpt = load_checkpoint(moe)
    counts = count_routing(Model(ckpt.config, ckpt.tensors), [PROMPT])
    hot = tmp_path / "hot.json"
    save_counts(hot, counts, model=str(moe), tokens=len(PROMPT))
    source = RecordingSource(CheckpointSource(moe))
    logs: list[tuple[str, dict]] = []
    # chunks of 2 experts on the CPU side: its 5 experts of a layer go in 3 runs
    per_expert = 3 * 64 * 64 * 4
    model, experts = load_model(source, placement="split", cpu_experts_per_layer=5,
                                cpu_workers=1, hot_experts=hot, chunk_bytes=2 * per_expert,
                                log=lambda event, **f: logs.append((event, f)))
    ref_model, ref = _old_way(moe, 5, counts)
    try:
        np.testing.assert_array_equal(_logits(model, experts), _logits(ref_model, ref))
        for i, c in counts.items():
            order = hot_order(c)
            cpu_reads = [e for name, e in source.reads
                         if name == f"model.layers.{i}.mlp.experts.up_proj"]
            # every expert read exactly once, in the renumbered order, none as a whole stack
            assert sorted(sum(cpu_reads, ())) == list(range(8))
            assert sum(cpu_reads, ()) == tuple(order)
            assert experts.pool.layers[i].gate_q.tobytes() == ref.pool.layers[i].gate_q.tobytes()
        tokens = Engine(model, placement=experts, max_slots=1, max_len=64).generate(
            PROMPT, params=SamplingParams(temperature=0), max_tokens=5)
        assert tokens == Engine(ref_model, placement=ref, max_slots=1, max_len=64).generate(
            PROMPT, params=SamplingParams(temperature=0), max_tokens=5)
    finally:
        experts.close()
        ref.close()
    events = [e for e, _ in logs]
    assert events == ["load plan", "load dense", "load experts GPU", "load experts CPU",
                      "load workers ready", "model loaded"]
    fields = dict(logs)
    assert fields["load plan"]["experts_cpu_per_layer"] == [5]
    assert fields["load plan"]["experts_gpu_per_layer"] == [3]
    assert all(f["seconds"] >= 0 and "bytes" in f for e, f in logs if e.startswith("load "))
    assert fields["model loaded"]["cpu_bytes"] == experts.pool.shard_bytes > 0


def test_cpu_placement_reads_no_expert_for_the_backend(moe):
    source = RecordingSource(CheckpointSource(moe))
    model, experts = load_model(source, placement="cpu", cpu_workers=1)
    try:
        for name in source.shapes():
            if name.startswith("model.") and ".mlp.experts." in name:
                reads = [ids for n, ids in source.reads if n == name]
                assert reads[0] == ()  # the backend keeps no routed expert
                assert sorted(sum(reads[1:], ())) == list(range(8))  # each CPU expert once
        assert model.layers[0].mlp["experts.gate_proj"].shape == (0, 64, 64)
        assert experts.on_cpu[0].all()
    finally:
        experts.close()


def test_a_decided_split_plugs_in(moe):
    """expert_split (a memory plan's experts per layer and order) overrides the rule."""
    cfg = CheckpointSource(moe).config
    counts = {i: np.arange(8) for i in range(cfg.num_hidden_layers)}  # hottest: 7, 6, ...
    split = split_from_orders({i: np.arange(8)[::-1] for i in counts}, 3, counts)
    model, experts = load_model(moe, expert_split=split, cpu_workers=1)
    ref_model, ref = _old_way(moe, 3, counts)
    try:
        assert experts.hot_share[0] == pytest.approx((7 + 6 + 5 + 4 + 3) / 28)
        np.testing.assert_array_equal(_logits(model, experts), _logits(ref_model, ref))
    finally:
        experts.close()
        ref.close()
    with pytest.raises(ValueError, match="each id of 0..7 once"):
        split_from_orders({0: [0] * 8}, 3)
    with pytest.raises(ValueError, match=r"in 1..8 for 'split' \(layer 0: 9\)"):
        split_from_orders({0: range(8)}, {0: 9})


def test_progress_bar_over_bytes(moe, capsys):
    load_model(moe, progress=True)
    err = capsys.readouterr().err
    assert f"loading {moe.name}" in err and "100%" in err
    load_model(moe)
    assert capsys.readouterr().err == ""  # small model: no bar by default


# ---- peak host RSS of a streaming load (a child process, so its peak is its own) ---------
CHILD = r"""
import json, sys
import numpy as np
from cpu_experts.quant import quantize
from gpu_worker.engine import Engine, load_model
from protocol.messages import SamplingParams

def hwm():  # peak resident set of this process so far, bytes
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

quantize(np.ones((1, 32), np.float32))  # compiled code is not weights: in the baseline
base = hwm()
logs = {}
model, experts = load_model(sys.argv[1], placement="cpu", cpu_workers=1, chunk_bytes=16 << 20,
                            log=lambda event, **f: logs.update({event: f}))
peak = hwm()
prompt = np.arange(3, 40) * 11 % 1000
engine = Engine(model, placement=experts, max_slots=1, max_len=64)
logits = engine.score(prompt)
tokens = engine.generate(prompt, params=SamplingParams(temperature=0), max_tokens=4)
engine.close()
np.save(sys.argv[2], logits)
print(json.dumps({"base": base, "peak": peak, "tokens": tokens,
                  "backend": logs["model loaded"]["backend_bytes"],
                  "cpu": logs["model loaded"]["cpu_bytes"]}))
"""
BIG = {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2, "head_dim": 64, "experts": 96,
       "topk": 4, "moe_intermediate": 256, "intermediate": 1024, "vocab": 1024, "mtp": False}


def test_peak_rss_of_a_streaming_cpu_load(tmp_path):
    path = make_tiny_model(tmp_path / "big", "qwen3_moe", seed=1, tokenizer=False,
                           dtype="bfloat16", shards=4, expert_layout="fused", **BIG)
    files = sorted(path.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    assert on_disk > 250e6  # a few hundred MB of bf16
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tmp_path / "l.npy")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    working_set = max(f.stat().st_size for f in files)  # one shard
    bound = (got["backend"] + got["cpu"]) * 1.1 + working_set
    grew = got["peak"] - got["base"]
    print(f"peak RSS {got['peak'] / 2**20:.0f} MiB = baseline {got['base'] / 2**20:.0f} MiB "
          f"+ {grew / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB (backend "
          f"{got['backend'] / 2**20:.0f}, cpu {got['cpu'] / 2**20:.0f}, shard "
          f"{working_set / 2**20:.0f}); checkpoint {on_disk / 2**20:.0f} MiB")
    assert grew <= bound
    assert bound < 2 * on_disk  # the float32 model (2x the bf16 bytes) would not fit
    # the same tokens and logits as the old all-at-once load with the same quantization
    ref_model, ref = _old_way(path, BIG["experts"])
    try:
        engine = Engine(ref_model, placement=ref, max_slots=1, max_len=64)
        prompt = np.arange(3, 40) * 11 % 1000
        np.testing.assert_array_equal(np.load(tmp_path / "l.npy"), engine.score(prompt))
        assert got["tokens"] == engine.generate(prompt, params=SamplingParams(temperature=0),
                                                max_tokens=4)
    finally:
        ref.close()
