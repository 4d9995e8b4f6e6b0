"""Hottest-by-frequency placement: router counts, the renumbering that leaves a layer's
function unchanged, the split placement that keeps the hottest experts on the GPU, the
counts file's checks, the config key and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cpu_experts import shard
from daemon.cli import main as tandem
from daemon.config import DEFAULT_MODEL, ConfigError, load_config
from gpu_worker.engine import Engine
from gpu_worker.expert_stats import (
    count_routing,
    hot_order,
    load_counts,
    permute_experts,
    save_counts,
)
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

PROMPT = np.arange(5, 45) * 7 % 500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_moe", seed=3, tokenizer=False,
                           moe_intermediate=64)


def _logits(model: Model) -> np.ndarray:
    caches = model.new_caches(1, 64)
    return model.forward(RaggedBatch.build([(0, 0, PROMPT)]), caches,
                         np.arange(len(PROMPT))).logits


def test_counts_add_up_to_every_rows_top_k(tiny):
    ckpt = load_checkpoint(tiny, dtype=np.float64)
    model = Model(ckpt.config, ckpt.tensors, dtype=np.float64)
    counts = count_routing(model, [PROMPT[:30], PROMPT[30:], []])
    cfg = ckpt.config
    assert sorted(counts) == [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
    for c in counts.values():
        assert c.shape == (cfg.num_experts,) and c.sum() == len(PROMPT) * cfg.num_experts_per_tok
    again = count_routing(model, [PROMPT[:30], PROMPT[30:]])
    assert all((again[i] == counts[i]).all() for i in counts)
    assert any(len(set(c.tolist())) > 1 for c in counts.values())  # not uniform


def test_renumbering_the_experts_keeps_the_layer_function(tiny):
    ckpt = load_checkpoint(tiny, dtype=np.float64)
    model = Model(ckpt.config, ckpt.tensors, dtype=np.float64)
    want = _logits(model)
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if layer.sparse:
            permute_experts(layer.mlp, rng.permutation(ckpt.config.num_experts))
    got = _logits(model)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_split_placement_keeps_the_hottest_experts_on_the_gpu(tiny, tmp_path):
    ckpt = load_checkpoint(tiny)
    cfg = ckpt.config
    model = Model(cfg, ckpt.tensors)
    counts = count_routing(model, [PROMPT])
    path = tmp_path / "hot.json"
    save_counts(path, counts, model=str(tiny), tokens=len(PROMPT))
    E, n_cpu = cfg.num_experts, 4
    engine = Engine.from_dir(tiny, placement="split", cpu_experts_per_layer=n_cpu,
                             cpu_workers=1, hot_experts=path, max_slots=1, max_len=64)
    try:
        for i, c in counts.items():
            order = hot_order(c)
            assert c[order].tolist() == sorted(c.tolist(), reverse=True)
            p = f"model.layers.{i}.mlp."
            mlp = engine.model.layers[i].mlp
            # the GPU holds the hottest E - n_cpu experts, renumbered 0..; the router follows
            hot = order[:E - n_cpu]
            np.testing.assert_array_equal(mlp["experts.gate_proj"],
                                          ckpt.tensors[p + "experts.gate_proj"][hot])
            np.testing.assert_array_equal(mlp["gate.weight"],
                                          ckpt.tensors[p + "gate.weight"][order])
            # the CPU workers hold the coldest, quantized
            cold = shard.quantize_layer(*(ckpt.tensors[p + "experts." + k][order[E - n_cpu:]]
                                          for k in ("gate_proj", "up_proj", "down_proj")))
            assert engine.placement.pool.layers[i].gate_q.tobytes() == cold.gate_q.tobytes()
            assert engine.placement.hot_share[i] == pytest.approx(
                c[order[:E - n_cpu]].sum() / c.sum())
            assert engine.placement.hot_share[i] >= (E - n_cpu) / E
        out = engine.generate(PROMPT, params=SamplingParams(temperature=0), max_tokens=6)
        assert len(out) == 6
    finally:
        engine.close()


@pytest.mark.parametrize("doc,message", [
    ({"format": "other"}, "is not a tandem-expert-counts-v1 file"),
    ({"format": "tandem-expert-counts-v1", "layers": {"0": [1, 2]}}, "needs 8 non-negative"),
    ({"format": "tandem-expert-counts-v1", "layers": {"9": [1] * 8}}, "not a MoE layer"),
    ({"format": "tandem-expert-counts-v1", "layers": {"0": [1] * 8}}, "lacks MoE layers"),
])
def test_bad_counts_files_are_refused_by_name(tiny, tmp_path, doc, message):
    path = tmp_path / "hot.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        load_counts(path, load_checkpoint(tiny).config)
    with pytest.raises(ValueError, match="cannot read"):
        load_counts(tmp_path / "missing.json", load_checkpoint(tiny).config)


def test_config_key_needs_split_and_an_existing_file(tmp_path):
    hot = tmp_path / "hot.json"
    hot.write_text("{}")
    toml = tmp_path / "t.toml"
    toml.write_text('[experts]\nplacement = "split"\ncpu_experts_per_layer = 2\n'
                    'hot_experts = "hot.json"\n')
    assert load_config(toml).experts.hot_experts == hot.resolve()
    toml.write_text('[experts]\nhot_experts = "hot.json"\n')
    with pytest.raises(ConfigError, match="experts.hot_experts: needs placement = 'split'"):
        load_config(toml)
    toml.write_text('[experts]\nplacement = "split"\ncpu_experts_per_layer = 2\n'
                    'hot_experts = "nope.json"\n')
    with pytest.raises(ConfigError, match="experts.hot_experts: must be an existing file"):
        load_config(toml)


def test_cli_writes_the_counts_of_a_text(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("def reverse(s):\n    return s[::-1]\n" * 20)
    out = tmp_path / "hot.json"
    assert tandem(["expert-stats", "--text", str(text), "--chunk-tokens", "64",
                   "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    sums = {sum(v) for v in data["layers"].values()}
    assert sums == {data["tokens"] * cfg["num_experts_per_tok"]}
    assert "router picks" in capsys.readouterr().out
    assert tandem(["expert-stats", "--text", str(tmp_path / "none.txt"), "--out",
                   str(out)]) == 2
