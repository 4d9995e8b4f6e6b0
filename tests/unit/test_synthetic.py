"""The synthetic weight source: deterministic tensors (same seed, same bytes; subsets are
slices), sane scales, a tiny synthetic model of both architectures runs and speculation
stays exact with synthetic routing; `synthetic:` specs; make_tiny_model's --vocab."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from daemon.tokenizer import Tokenizer
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.weights.resolve import open_source, parse_spec
from gpu_worker.weights.routing import RoutingParams
from gpu_worker.weights.synthetic import DEFAULT_ROUTING, SyntheticSource
from scripts.tiny_model import DEFAULT_SIZES, build_config, make_tiny_model
from tests.unit.test_speculation import _serve

EXPERTS = "model.layers.1.mlp.experts.down_proj"


def _config(arch: str, **sizes) -> ModelConfig:
    return ModelConfig.from_dict(build_config(arch, {**DEFAULT_SIZES, **sizes}, "bfloat16",
                                              [0]))


def _tensors(src: SyntheticSource, dtype=np.float64) -> dict[str, np.ndarray]:
    return {name: src.read(name, dtype) for name in src.shapes()}


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_same_seed_same_bytes_and_subsets_are_slices(arch):
    cfg = _config(arch)
    a, b = SyntheticSource(cfg, seed=3), SyntheticSource(cfg, seed=3)
    ta, tb = _tensors(a, np.float32), _tensors(b, np.float32)
    assert set(ta) == set(a.shapes()) and all(ta[n].shape == s for n, s in a.shapes().items())
    assert all(ta[n].tobytes() == tb[n].tobytes() for n in ta)
    other = SyntheticSource(cfg, seed=4).read(EXPERTS, np.float32)
    assert not np.array_equal(other, ta[EXPERTS])
    picked = a.read(EXPERTS, np.float32, experts=[5, 1, 5])
    assert np.array_equal(picked, ta[EXPERTS][[5, 1, 5]])
    # every value is a bfloat16 value: the storage dtype does not change them
    as_bf16 = a.read(EXPERTS, ml_dtypes.bfloat16, experts=[2]).astype(np.float64)
    assert np.array_equal(as_bf16, a.read(EXPERTS, np.float64, experts=[2]))
    assert a.nbytes(EXPERTS) == 2 * ta[EXPERTS].size
    with pytest.raises(ValueError, match="out of range"):
        a.read(EXPERTS, np.float32, experts=[cfg.num_experts])
    with pytest.raises(KeyError, match="no tensor"):
        a.read("model.layers.99.mlp.gate.weight", np.float32)


def test_row_blocks_of_large_tensors_are_independent_of_the_reader(monkeypatch):
    """Large non-expert tensors are made in row blocks, possibly on threads; a thread pool
    and the one-by-one path give the same values."""
    import gpu_worker.weights.synthetic as synthetic

    cfg = _config("qwen3_moe", vocab=3000)
    monkeypatch.setattr(synthetic, "UNIT_ELEMS", 1024)
    monkeypatch.setattr(synthetic, "_THREADS", 4)
    threaded = SyntheticSource(cfg, seed=1).read("model.embed_tokens.weight", np.float32)
    monkeypatch.setattr(synthetic, "_THREADS", 1)
    single = SyntheticSource(cfg, seed=1).read("model.embed_tokens.weight", np.float32)
    assert np.array_equal(threaded, single)
    assert abs(single.std() * np.sqrt(cfg.hidden_size) - 1) < 0.02  # std 1/sqrt(fan_in)


def test_scales_and_neutral_parts():
    cfg = _config("qwen3_next", hidden=256, moe_intermediate=128)
    src = SyntheticSource(cfg, seed=0)
    up = src.read("model.layers.0.mlp.experts.up_proj", np.float64)  # [E, I, H]
    assert abs(up.std() * np.sqrt(256) - 1) < 0.02 and abs(up.mean()) < 1e-3
    assert not src.read("model.layers.3.self_attn.q_norm.weight", np.float32).any()  # 1 + 0
    assert (src.read("model.layers.0.linear_attn.norm.weight", np.float32) == 1).all()
    a = np.exp(src.read("model.layers.0.linear_attn.A_log", np.float64))
    assert ((a >= 0.99) & (a <= 16.1)).all()


def _synthetic_model(arch: str, routing: RoutingParams = DEFAULT_ROUTING, **sizes) -> Model:
    src = SyntheticSource(_config(arch, **sizes), seed=2, routing=routing)
    return Model(src.config, _tensors(src), dtype=np.float64, exact=True, routing=src.routing)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_a_tiny_synthetic_model_runs_and_routes_by_the_routing_model(arch):
    model = _synthetic_model(arch)
    caches = model.new_caches(2, 64)
    batch = RaggedBatch.build([(0, 0, np.arange(1, 20)), (1, 0, np.arange(30, 35))])
    out = model.forward(batch, caches, np.arange(batch.num_rows))
    assert np.isfinite(out.logits).all() and out.logits.shape == (24, model.cfg.vocab_size)
    from gpu_worker.expert_stats import count_routing  # noqa: PLC0415

    counts = count_routing(model, [np.arange(1, 40)])
    expected = np.bincount(model.routing.choose(0, np.zeros(39), np.arange(39)).ravel(),
                           minlength=model.cfg.num_experts)
    assert np.array_equal(counts[0], expected)


def test_activations_stay_sane_through_48_layers():
    model = _synthetic_model("qwen3_next", layers=48, hidden=64, vocab=256)
    caches = model.new_caches(1, 64)
    out = model.forward(RaggedBatch.build([(0, 0, np.arange(40))]), caches, np.arange(40))
    assert np.isfinite(out.logits).all()
    assert 0.1 < out.logits.std() < 10  # neither vanishing nor exploding


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_speculation_stays_exact_with_synthetic_routing(arch):
    """Draft rows at position p route like plain decoding's row at p: verification of
    suffix and MTP drafts (a random model rejects most) gives plain decoding's tokens."""
    model = _synthetic_model(arch, RoutingParams(0.8, 0.5), experts=8, topk=2)
    for temperature in (0.0, 0.9):
        plain, _ = _serve(model, "off", temperature)
        for mode, spec in (("narrow", {"min_match": 1}), ("wide", {"min_match": 1}),
                           ("wide", {"proposer": "mtp", "num_drafts": 3})):
            got, worker = _serve(model, mode, temperature, **spec)
            assert got == plain, (mode, spec)
            if model.mtp is not None or "proposer" not in spec:
                assert sum(len(w.draft_ids) for p in worker.plans for w in p.slots) > 0


def test_specs_name_configs_seeds_and_knobs(tmp_path):
    src = open_source("synthetic:qwen3-next-80b-a3b?seed=7&skew=0.5&locality=0.25")
    assert isinstance(src, SyntheticSource) and src.path is None and src.seed == 7
    cfg = src.config
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (48, 512, 10)
    assert cfg.num_mtp_layers == 1 and "mtp.fc.weight" in src.shapes()
    assert src.routing.params == RoutingParams(0.5, 0.25)
    assert src.nbytes("model.layers.0.mlp.experts.gate_proj") == 512 * 512 * 2048 * 2
    assert src.read("model.norm.weight", np.float32).shape == (2048,)
    moe = open_source("synthetic:qwen3-30b-a3b")
    assert moe.config.head_dim == 128 and moe.routing.params == DEFAULT_ROUTING
    assert open_source("synthetic:qwen3-next-80b-a3b?mtp=0").config.num_mtp_layers == 0
    raw = build_config("qwen3_moe", DEFAULT_SIZES, "float32", [0])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert open_source(f"synthetic:{tmp_path}").config.hidden_size == DEFAULT_SIZES["hidden"]
    assert parse_spec(f"synthetic:{tmp_path}/config.json")[0] == tmp_path / "config.json"
    for bad, match in (("synthetic:nope", "no config named"), ("synthetic:", "name a config"),
                       ("synthetic:qwen3-30b-a3b?seed=x", "must be int"),
                       ("synthetic:qwen3-30b-a3b?color=1", "unknown")):
        with pytest.raises(ValueError, match=match):
            open_source(bad)


@pytest.mark.parametrize("vocab", [512, 32000])
def test_make_tiny_model_writes_a_tokenizer_of_exactly_vocab_ids(tmp_path, vocab):
    path = make_tiny_model(tmp_path, "qwen3_moe", vocab=vocab, layers=1, hidden=16, heads=2,
                           kv_heads=1, head_dim=8, experts=2, topk=1, moe_intermediate=8)
    tok = Tokenizer.from_dir(path)
    assert tok.backend.get_vocab_size() == vocab
    assert tok.eos_token_ids and max(tok.eos_token_ids) < vocab
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    assert len(tok.decode(list(range(vocab - 200, vocab - 7)))) > 0  # every id decodes


def test_a_vocab_too_small_for_bytes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab must be at least"):
        make_tiny_model(tmp_path, "qwen3_moe", vocab=100)
