"""Tandem's NumPy model against Hugging Face transformers 5.x (the independent reference).

Checkpoints come two ways: built and saved by transformers itself (then read by Tandem's
loader), and written by make_tiny_model (then read by transformers). Under CI these tests
must run, never skip: .ci/run fails when any parity test is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # an ImportError here fails the run: parity tests never skip
import transformers

from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

pytestmark = pytest.mark.parity

PROMPT_LEN, DECODE_STEPS, GREEDY_TOKENS = 24, 32, 64

MOE_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
NEXT_BASE = dict(MOE_BASE, num_hidden_layers=4, head_dim=16, shared_expert_intermediate_size=48,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=12)

# (name, class, config overrides, initializer_range, logits tolerance)
HF_CASES = [
    ("moe-headdim-tied-nonorm", "Qwen3MoeForCausalLM",
     dict(head_dim=24, tie_word_embeddings=True, norm_topk_prob=False, mlp_only_layers=[1]),
     0.02, 1e-4),
    ("moe-sparse-step2-scaled", "Qwen3MoeForCausalLM",
     dict(decoder_sparse_step=2, num_hidden_layers=4, rope_theta=1e6), 0.2, 1e-3),
    ("next-hv3-rot05", "Qwen3NextForCausalLM",
     dict(linear_num_value_heads=6, partial_rotary_factor=0.5), 0.02, 1e-4),
    ("next-tied-dense-scaled", "Qwen3NextForCausalLM",
     dict(tie_word_embeddings=True, mlp_only_layers=[0], decoder_sparse_step=2,
          norm_topk_prob=False, head_dim=24), 0.2, 1e-3),
]


def _hf_model(cls_name: str, overrides: dict, init_range: float, seed: int = 0,
              logits_scale: float | None = None):
    base = MOE_BASE if "Moe" in cls_name else NEXT_BASE
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    config = cfg_cls(**{**base, **overrides}, initializer_range=init_range)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # random (not neutral) norm weights, so norm conventions matter
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    if logits_scale:  # scale the final norm so that max |logits| on a probe is logits_scale
        factor = logits_scale / np.abs(_hf_logits(model, np.arange(32) % 7)).max()
        with torch.no_grad():
            w = model.model.norm.weight
            w.copy_((1 + w) * factor - 1 if "Next" in cls_name else w * factor)
    return model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float().numpy()


def _hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    """Plain greedy decoding with transformers' cache (no EOS handling, no processors)."""
    out = []
    with torch.no_grad():
        res = model(torch.tensor(prompt)[None], use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([[out[-1]]]), cache=res.past_key_values, use_cache=True)
    return np.array(out)


def _check_model(hf, path, tol: float, vocab: int, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, size=PROMPT_LEN)
    engine = Engine.from_dir(path, dtype="float32", max_slots=1, max_len=256)

    # prefill: every prompt position, in one pass
    ref = _hf_logits(hf, prompt)
    ours = engine.score(prompt)
    assert np.abs(ref).max() > 10 * tol  # the comparison is not vacuous
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)

    # greedy generation through both incremental (cached) paths, token for token
    gen = _hf_greedy(hf, prompt, GREEDY_TOKENS)
    out = engine.generate(prompt, params=SamplingParams(temperature=0), max_tokens=GREEDY_TOKENS)
    assert out == gen.tolist()

    # 32 incremental decode steps (feeding the generated tokens) against a full forward
    full = np.concatenate([prompt, gen[:DECODE_STEPS]])
    ref = _hf_logits(hf, full)[PROMPT_LEN:]
    engine.prefill(0, prompt)
    for i in range(DECODE_STEPS):
        pos = PROMPT_LEN + i
        logits = engine.forward([(0, pos, full[pos:pos + 1])]).logits
        np.testing.assert_allclose(logits[0], ref[i], rtol=0, atol=tol)


@pytest.mark.parametrize("name,cls_name,overrides,init_range,tol", HF_CASES,
                         ids=[c[0] for c in HF_CASES])
def test_checkpoint_saved_by_transformers(tmp_path, name, cls_name, overrides, init_range, tol):
    scaled = tol > 1e-4
    hf = _hf_model(cls_name, overrides, init_range, logits_scale=10.0 if scaled else None)
    hf.save_pretrained(tmp_path)
    _check_model(hf, tmp_path, tol, hf.config.vocab_size)
    if scaled:  # really the |logits| ~ 10 regime
        assert 5 < np.abs(_hf_logits(hf, np.arange(40) % 11)).max() < 20


TINY_CASES = [
    ("qwen3_moe", dict(tie_embeddings=True, head_dim=24), "float32", "per_expert", 0.02, 1e-4),
    ("qwen3_moe", dict(decoder_sparse_step=2, no_norm=True), "bfloat16", "fused", 0.2, 1e-3),
    ("qwen3_next", dict(linear_value_heads=6, partial_rotary_factor=0.5), "float32",
     "per_expert", 0.02, 1e-4),
    ("qwen3_next", dict(mlp_only_layers=(1,), tie_embeddings=True), "float16", "fused", 0.2,
     1e-3),
]


@pytest.mark.parametrize("arch,sizes,dtype,layout,std,tol", TINY_CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in TINY_CASES])
def test_checkpoint_written_by_make_tiny_model(tmp_path, arch, sizes, dtype, layout, std, tol):
    sizes = dict(sizes)
    if sizes.pop("no_norm", False):
        sizes["norm_topk_prob"] = False
    path = make_tiny_model(tmp_path / arch, arch, seed=3, dtype=dtype, expert_layout=layout,
                           std=std, vocab=300, **sizes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_model(hf, path, tol, 300)
