"""The MTP head against a plain NumPy transcription of docs/architecture.md §11's formula,
chained 3 deep.

The reference below shares no code with gpu_worker.model: it recomputes the head from the
canonical tensors with whole-sequence attention and a per-token loop over experts.
"""

import numpy as np
import pytest

from gpu_worker.engine import Engine
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from scripts.tiny_model import make_tiny_model


def _norm(x, w, eps):  # zero-centred RMSNorm (all four MTP norms are)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + w)


def _silu(x):
    return x / (1 + np.exp(-x))


def _rope(x, pos, rot, theta):  # x [heads, hd] at one position, rotate-half over rot dims
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    ang = pos * np.concatenate([inv, inv])
    xr = x[:, :rot]
    half = np.concatenate([-xr[:, rot // 2:], xr[:, :rot // 2]], axis=1)
    return np.concatenate([xr * np.cos(ang) + half * np.sin(ang), x[:, rot:]], axis=1)


class ReferenceMTP:
    def __init__(self, cfg, t):
        self.c, self.t, self.p = cfg, t, "mtp.layers.0."
        self.keys, self.values = [], []  # the head's own cache, one entry per position

    def step(self, token, hidden, pos):
        """x = fc([norm_e(embed(token)), norm_h(hidden)]); decoder layer; mtp.norm."""
        c, t, p = self.c, self.t, self.p
        eps = c.rms_norm_eps
        e = _norm(t["model.embed_tokens.weight"][token], t["mtp.pre_fc_norm_embedding.weight"], eps)
        h = _norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)
        x = t["mtp.fc.weight"] @ np.concatenate([e, h])
        a = _norm(x, t[p + "input_layernorm.weight"], eps)
        x = x + self._attention(a, pos)
        m = _norm(x, t[p + "post_attention_layernorm.weight"], eps)
        x = x + self._moe(m)
        out = _norm(x, t["mtp.norm.weight"], eps)
        return t["lm_head.weight"] @ out, out

    def _attention(self, a, pos):
        c, t, p = self.c, self.t, self.p + "self_attn."
        hd, hq, hk = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        qg = (t[p + "q_proj.weight"] @ a).reshape(hq, 2 * hd)
        q, gate = qg[:, :hd], qg[:, hd:].reshape(-1)
        k = (t[p + "k_proj.weight"] @ a).reshape(hk, hd)
        v = (t[p + "v_proj.weight"] @ a).reshape(hk, hd)
        q = _rope(_norm(q, t[p + "q_norm.weight"], c.rms_norm_eps), pos, c.rotary_dim, c.rope_theta)
        k = _rope(_norm(k, t[p + "k_norm.weight"], c.rms_norm_eps), pos, c.rotary_dim, c.rope_theta)
        self.keys.append(k)
        self.values.append(v)
        K, V = np.stack(self.keys), np.stack(self.values)  # [L, hk, hd]
        out = np.zeros((hq, hd))
        for head in range(hq):
            kv = head // (hq // hk)
            s = K[:, kv] @ q[head] / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[head] = (w / w.sum()) @ V[:, kv]
        return t[p + "o_proj.weight"] @ (out.reshape(-1) / (1 + np.exp(-gate)))

    def _moe(self, m):
        c, t, p = self.c, self.t, self.p + "mlp."
        logits = t[p + "gate.weight"] @ m
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[: c.num_experts_per_tok]
        w = probs[top] / (probs[top].sum() if c.norm_topk_prob else 1.0)
        out = np.zeros_like(m)
        for e, we in zip(top, w, strict=True):
            g = t[p + "experts.gate_proj"][e] @ m
            u = t[p + "experts.up_proj"][e] @ m
            out += we * (t[p + "experts.down_proj"][e] @ (_silu(g) * u))
        shared = t[p + "shared_expert.down_proj.weight"] @ (
            _silu(t[p + "shared_expert.gate_proj.weight"] @ m)
            * (t[p + "shared_expert.up_proj.weight"] @ m))
        sg = 1 / (1 + np.exp(-(t[p + "shared_expert_gate.weight"] @ m)[0]))
        return out + sg * shared


@pytest.mark.parametrize("sizes", [dict(), dict(heads=6, kv_heads=2, partial_rotary_factor=0.5,
                                               norm_topk_prob=False, std=0.2)])
def test_mtp_head_matches_reference_chained_three_deep(tmp_path, sizes):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=11, tokenizer=False, **sizes)
    ckpt = load_checkpoint(path, dtype=np.float64)
    engine = Engine.from_dir(path, dtype="float64", max_slots=2, max_len=64)
    model, caches = engine.model, engine.caches
    rng = np.random.default_rng(2)
    seq = rng.integers(0, ckpt.config.vocab_size, size=13)  # prompt tokens 0..11, token 12 known
    n = 12
    main = model.forward(RaggedBatch.build([(1, 0, seq[:n])]), caches)
    hidden = main.hidden  # [n, H] final-normed h_t

    # Tandem: the head over the whole prompt (row t: token_{t+1}, h_t, position t) ...
    got = model.mtp_forward(RaggedBatch.build([(1, 0, seq[1:n + 1])]), hidden, caches)
    ref = ReferenceMTP(ckpt.config, ckpt.tensors)
    for t in range(n):
        logits, out = ref.step(seq[t + 1], hidden[t], t)
        np.testing.assert_allclose(got.logits[t], logits, rtol=0, atol=1e-10)
        np.testing.assert_allclose(got.hidden[t], out, rtol=0, atol=1e-10)

    # ... then chained: each draft feeds the head's own normed output and its drafted token
    draft, h = int(np.argmax(got.logits[-1])), got.hidden[-1]
    ref_draft, ref_h = int(np.argmax(logits)), out
    for depth in range(1, 3):
        pos = n - 1 + depth
        step = model.mtp_forward(RaggedBatch.build([(1, pos, [draft])]), h[None], caches)
        r_logits, ref_h = ref.step(ref_draft, ref_h, pos)
        np.testing.assert_allclose(step.logits[0], r_logits, rtol=0, atol=1e-10)
        draft, h = int(np.argmax(step.logits[0])), step.hidden[0]
        ref_draft = int(np.argmax(r_logits))
        assert draft == ref_draft
    assert np.abs(r_logits).max() > 1e-3  # not a vacuous comparison


def test_the_heads_kv_travels_with_shared_prefix_blocks_and_swaps(tmp_path):
    """The MTP head's KV is a layer of the main cache: a slot that shares a prefix's blocks
    sees the head's rows of that prefix (its drafts equal the first slot's, bit for bit), a
    write past the prefix copies the block first, and a swap-out/in keeps the rows."""
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False)
    engine = Engine.from_dir(path, dtype="float64", max_slots=3, max_len=64, block_size=4)
    model, caches = engine.model, engine.caches
    kv, mtp = caches.kv, model.mtp_layer.cache_index
    assert mtp == kv.num_layers - 1
    ids = np.arange(3, 15) * 13 % 400  # 12 tokens
    hidden = model.forward(RaggedBatch.build([(0, 0, ids)]), caches).hidden
    first = model.mtp_forward(RaggedBatch.build([(0, 0, ids[1:])]), hidden[:11], caches)
    k0, v0 = (a.copy() for a in kv.read(mtp, 0, 11))
    assert np.abs(k0).sum() > 0

    kv.share(1, kv.tables[0][:2])  # the first 8 positions, as a prefix-cache hit
    np.testing.assert_array_equal(kv.read(mtp, 1, 8)[0], k0[:8])
    if caches.states is not None:  # not needed by the head, which is full attention only
        caches.states.reset(1)
    # the head's rows 7..10 for slot 1 over the shared rows: slot 0's logits (to rounding:
    # attention over 4 queries instead of 11); row 7 lies in the shared block 1, which slot 1
    # gets its own copy of before writing. Without the prefix's rows (a slot of its own, as
    # when the head had a cache apart) the logits are far off.
    again = model.mtp_forward(RaggedBatch.build([(1, 7, ids[8:])]), hidden[7:11], caches)
    np.testing.assert_allclose(again.logits, first.logits[7:11], rtol=0, atol=1e-12)
    alone = model.mtp_forward(RaggedBatch.build([(2, 7, ids[8:])]), hidden[7:11], caches)
    assert np.abs(alone.logits - first.logits[7:11]).max() > 1e-3
    caches.reset_slot(2)
    assert kv.tables[1][0] == kv.tables[0][0] and kv.tables[1][1] != kv.tables[0][1]
    np.testing.assert_array_equal(kv.read(mtp, 0, 11)[0], k0)  # slot 0 unchanged by slot 1

    from gpu_worker.cache_ops import CacheOps

    ops = CacheOps(caches, max_slots=3)
    ops.lengths[0] = 11
    entry = ops.swap_out(0)
    assert 0 not in kv.tables
    ops.swap_in(2, entry)
    np.testing.assert_array_equal(kv.read(mtp, 2, 11)[0], k0)
    np.testing.assert_array_equal(kv.read(mtp, 2, 11)[1], v0)
