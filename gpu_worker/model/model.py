"""The whole model (Qwen3-MoE or Qwen3-Next) over a ragged batch, plus the MTP head."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from gpu_worker.kv_cache import KVCache
from gpu_worker.model.attention import (
    QKV_GATED_PARTS,
    QKV_PARTS,
    QKV_STACK,
    StepMeta,
    full_attention,
    q_rows,
)
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.gdn import GDN_IN_PARTS, GDN_IN_STACK, gated_deltanet, qkvz_rows
from gpu_worker.model.moe import IN_STACK, IN_STACK_PARTS, dense_mlp, sparse_moe
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig
from gpu_worker.routed_experts import RoutedExperts
from gpu_worker.states import RecurrentStates
from gpu_worker.step_inputs import StepInputs, host_inputs, step_inputs, upload
from gpu_worker.weights.routing import RoutingModel, RowRouting


@dataclasses.dataclass
class Caches:
    """Everything per-slot the model reads and writes: KV (the MTP head's as its last layer:
    it lives in the same blocks, so prefix sharing, copy-on-write and swaps carry it along)
    and GDN states."""

    kv: KVCache
    states: RecurrentStates | None

    def reset_slot(self, slot: int) -> None:
        self.kv.free_slot(slot)
        if self.states is not None:
            self.states.reset(slot)


@dataclasses.dataclass
class ForwardOut:
    logits: Array  # [len(logit_rows), V]
    hidden: Array  # [R, H] final-normed hidden state of every row (the MTP head's input)


@dataclasses.dataclass
class _Layer:
    input_norm: Array
    post_norm: Array
    attn: dict[str, Array]
    mlp: dict[str, Array]
    full: bool
    sparse: bool
    cache_index: int  # index among full-attention (KV) or linear-attention (state) layers
    index: int  # the layer's number (the MTP layer: num_hidden_layers)


class Model:
    """Weights on the array backend and the forward pass; caches are passed in.

    ``tensors`` are canonical (see gpu_worker.weights_spec): routed experts stacked per layer;
    a dict of host arrays, or (name, host array) pairs uploaded one at a time as they come
    (the streaming load, gpu_worker/weights/stream.py, drops each host array once uploaded).
    """

    def __init__(self, config: ModelConfig,
                 tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], *, xp=np,
                 dtype=np.float32, exact: bool = False,
                 routing: RoutingModel | None = None) -> None:
        self.cfg = config
        self.routing = routing  # synthetic weights: picks experts instead of the router
        self.ops = Ops(xp, dtype, exact=exact)
        self.xp = xp
        if isinstance(tensors, Mapping):  # a tied lm_head (the embedding's array) goes once
            embed = tensors.get("model.embed_tokens.weight")
            tensors = ((k, v) for k, v in tensors.items()
                       if not (k == "lm_head.weight" and v is embed))
        w = {k: self.ops.weight(k, v) for k, v in tensors}
        if xp is not np:
            stack_inputs(xp, w, config)
        self.embed = w["model.embed_tokens.weight"]  # [V, H]
        self.lm_head = w.get("lm_head.weight", self.embed)  # [V, H]
        self.final_norm = w["model.norm.weight"]
        full_i = linear_i = 0
        self.layers: list[_Layer] = []
        for i in range(config.num_hidden_layers):
            full = config.is_full_attention(i)
            self.layers.append(self._make_layer(w, f"model.layers.{i}.", full,
                                                config.is_sparse(i), full_i if full else linear_i,
                                                i))
            full_i, linear_i = full_i + full, linear_i + (not full)
        self.mtp: dict[str, Array] | None = None
        self.mtp_layer: _Layer | None = None
        if config.num_mtp_layers and "mtp.fc.weight" in w:
            self.mtp = _sub(w, "mtp.")
            # its KV: the layer after the model's full-attention layers in the same cache
            self.mtp_layer = self._make_layer(w, "mtp.layers.0.", True, config.num_experts > 0,
                                              full_i, config.num_hidden_layers)

    @staticmethod
    def _make_layer(w: dict[str, Array], prefix: str, full: bool, sparse: bool,
                    cache_index: int, index: int) -> _Layer:
        p = _sub(w, prefix)
        return _Layer(p["input_layernorm.weight"], p["post_attention_layernorm.weight"],
                      _sub(p, "self_attn." if full else "linear_attn."), _sub(p, "mlp."),
                      full, sparse, cache_index, index)

    # ---- caches ------------------------------------------------------------------------
    def new_caches(self, max_slots: int, max_tokens_per_slot: int, block_size: int = 16,
                   extra_blocks: int = 0, kv_int8: bool = False) -> Caches:
        """KV blocks for ``max_slots`` slots of ``max_tokens_per_slot`` tokens and
        ``extra_blocks`` more; Gated DeltaNet states for the slots."""
        cfg, xp, dt = self.cfg, self.xp, self.ops.dtype
        blocks = max_slots * -(-max_tokens_per_slot // block_size) + extra_blocks
        kv = KVCache(xp, len(cfg.full_attention_layers) + (self.mtp is not None), blocks,
                     block_size, cfg.num_key_value_heads, cfg.head_dim, dt, quant=kv_int8)
        states = None
        if cfg.linear_attention_layers:
            states = RecurrentStates(xp, len(cfg.linear_attention_layers), max_slots,
                                     cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
                                     cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim, np.promote_types(dt, np.float32))
        return Caches(kv, states)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, batch: RaggedBatch, caches: Caches, logit_rows=None,
                experts: RoutedExperts | None = None,
                inputs: StepInputs | None = None) -> ForwardOut:
        """Run every row of ``batch``; logits only for ``logit_rows`` (default: each
        segment's last row). ``experts``: the MoE layers' norm and routed experts (e.g. an
        ExpertPlacement, gpu_worker/experts/placement.py); None: every expert here.
        ``inputs``: the pass's host-built inputs already on the backend (gpu_worker/
        step_inputs.py; a CUDA graph's static buffers); None: made and uploaded here."""
        cfg, ops = self.cfg, self.ops
        if inputs is None:
            rows = batch.last_rows() if logit_rows is None else np.asarray(logit_rows)
            host = host_inputs(self, caches, batch, rows)
            inputs = step_inputs(self, caches, batch, upload(self.xp, host))
        x = ops.up(self.embed[inputs.tokens])  # [R, H]
        cos, sin = ops.rope_tables(inputs.positions, cfg.rotary_dim, cfg.rope_theta)  # [R, rot]
        routing = inputs.routing
        delta = None  # a layer's MLP output, added to x by the next norm (one launch)
        for layer in self.layers:
            x, delta = self._layer(layer, x, delta, batch, cos, sin, caches.kv, caches.states,
                                   experts, routing, inputs.meta, inputs.live)
        _, hidden = ops.add_rms_norm(x, delta, self.final_norm, cfg.rms_norm_eps,
                                     zero_centered=cfg.zero_centered_norms)  # [R, H]
        logits = ops.linear(hidden[inputs.logit_rows], self.lm_head)  # [n, V]
        return ForwardOut(logits, hidden)

    def _layer(self, layer: _Layer, x: Array, delta: Array | None, batch: RaggedBatch,
               cos: Array, sin: Array, kv: KVCache, states: RecurrentStates | None,
               experts: RoutedExperts | None, routing: RowRouting | None = None,
               meta: StepMeta | None = None, live: Array | None = None
               ) -> tuple[Array, Array]:
        """One decoder layer over the residual stream ``x + delta`` (``delta``: the previous
        layer's MLP output, or None) -> ``(x', delta')``: the stream after attention and this
        layer's MLP output, which the next norm adds (each add fused into the norm after it)."""
        cfg, ops = self.cfg, self.ops
        zc, eps = cfg.zero_centered_norms, cfg.rms_norm_eps
        x, h = ops.add_rms_norm(x, delta, layer.input_norm, eps, zero_centered=zc)
        if layer.full:
            a = full_attention(ops, cfg, layer.attn, h, batch, cos, sin, kv, layer.cache_index,
                               meta)
        else:
            a = gated_deltanet(ops, cfg, layer.attn, h, batch, states, layer.cache_index)
        if layer.sparse and experts is not None:
            x = x + a
            # [R, H], and (q [R, H] int8, d16 [R, H/32]) where the norm quantizes, else None
            h, quant = experts.moe_norm(x, layer.post_norm, eps, zc)
            return x, sparse_moe(ops, cfg, layer.mlp, h, experts, layer.index, quant, routing,
                                 live)
        x, h = ops.add_rms_norm(x, a, layer.post_norm, eps, zero_centered=zc)
        if layer.sparse:
            return x, sparse_moe(ops, cfg, layer.mlp, h, None, layer.index, None, routing, live)
        return x, dense_mlp(ops, layer.mlp, h)

    def mtp_forward(self, batch: RaggedBatch, hidden: Array, caches: Caches,
                    logit_rows=None, inputs: StepInputs | None = None) -> ForwardOut:
        """The MTP head: row r holds token_{t+1} at position t and ``hidden[r]`` = h_t.

        Returns logits (predicting token t+2) for ``logit_rows`` (default all rows) and the
        head's own normed output for every row (the hidden input of a chained draft).
        ``inputs``: the tokens, positions, logits rows, attention metadata (and live rows)
        already on the backend, as a CUDA graph's static buffers hold them (the tokens may be
        an earlier head pass's argmax, never on the host: gpu_worker/mtp_graph.py); the
        model's routing then comes from ``inputs`` too (None: the router's).
        """
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head")
        cfg, ops, xp, m = self.cfg, self.ops, self.xp, self.mtp
        zc, eps = cfg.zero_centered_norms, cfg.rms_norm_eps
        if inputs is None:
            tokens, positions = batch.tokens, xp.asarray(batch.positions)
            meta, routing, live = None, self._routing(batch), None
            rows = xp.asarray(np.arange(batch.num_rows) if logit_rows is None
                              else np.asarray(logit_rows))
        else:
            tokens, positions, rows = inputs.tokens, inputs.positions, inputs.logit_rows
            meta, routing, live = inputs.meta, inputs.routing, inputs.live
        e = ops.rms_norm(ops.embed(self.embed, tokens), m["pre_fc_norm_embedding.weight"],
                         eps, zero_centered=zc)
        h = ops.rms_norm(hidden, m["pre_fc_norm_hidden.weight"], eps, zero_centered=zc)
        x = ops.linear(xp.concatenate([e, h], axis=-1), m["fc.weight"])  # [R, H]
        cos, sin = ops.rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        x, delta = self._layer(self.mtp_layer, x, None, batch, cos, sin, caches.kv, None, None,
                               routing, meta, live)
        _, out = ops.add_rms_norm(x, delta, m["norm.weight"], eps, zero_centered=zc)  # [R, H]
        return ForwardOut(ops.linear(out[rows], self.lm_head), out)

    def _routing(self, batch: RaggedBatch) -> RowRouting | None:
        return None if self.routing is None else self.routing.bind_batch(batch)


# Matrices that read the same rows, stacked in one (``Ops.linear_split``: one launch, the
# bits of one product each): (block, the stack's name, its parts in order)
INPUT_STACKS = (("mlp.", IN_STACK, IN_STACK_PARTS),
                ("self_attn.", QKV_STACK, QKV_PARTS),
                ("self_attn.", QKV_STACK, QKV_GATED_PARTS),
                ("linear_attn.", GDN_IN_STACK, GDN_IN_PARTS))


def is_stack(name: str) -> bool:
    """Whether a weight name is an input stack (its bytes are its parts' views)."""
    return any(name.endswith(block + stack) or name == stack for block, stack, _ in INPUT_STACKS)


def stack_inputs(xp, w: dict[str, Array], cfg: ModelConfig) -> None:
    """Stack each layer's matrices of :data:`INPUT_STACKS` (a MoE layer's router and
    shared-expert projections, attention's q/k/v (a gated q_proj regrouped first into
    q_query and q_gate: attention.q_rows), Gated DeltaNet's input projections (its
    in_proj_qkvz regrouped first into in_proj_mixed and in_proj_z: gdn.qkvz_rows) in one
    matrix named ``<block><stack>``, and leave the parts' names as views into it: no extra
    memory once the originals are freed. A group whose parts differ in dtype or width, or
    that has biases, keeps its matrices apart."""
    if cfg.gated_attention:
        _regroup(xp, w, "self_attn.q_proj.weight", QKV_GATED_PARTS[:2], q_rows(cfg))
    if cfg.linear_num_key_heads:
        _regroup(xp, w, "linear_attn.in_proj_qkvz.weight", GDN_IN_PARTS[:2], qkvz_rows(cfg))
    for block, stack_name, parts_names in INPUT_STACKS:
        first = block + parts_names[0]
        for key in [k for k in w if k.endswith(first)]:
            prefix = key[: -len(parts_names[0])]
            names = [prefix + part for part in parts_names]
            parts = [w.get(n) for n in names]
            if any(a is None or a.ndim != 2 for a in parts) or len(
                    {(a.dtype, a.shape[1]) for a in parts}) != 1 or any(
                    _bias(n) in w for n in names):
                continue
            stack = xp.concatenate(parts)
            start = 0
            for n, a in zip(names, parts, strict=True):
                w[n] = stack[start:start + a.shape[0]]
                start += a.shape[0]
            w[prefix + stack_name] = stack
            del parts
    pool = getattr(xp, "get_default_memory_pool", None)
    if pool is not None:
        pool().free_all_blocks()  # the replaced originals back to the device


def _regroup(xp, w: dict[str, Array], suffix: str, names: tuple[str, str],
             rows: tuple[np.ndarray, np.ndarray]) -> None:
    """Each bias-free matrix ``*suffix`` of ``w`` replaced by two made of its ``rows``,
    named ``*names[0]`` and ``*names[1]``."""
    first, second = (xp.asarray(r) for r in rows)
    for key in [k for k in w if k.endswith(suffix) and _bias(k) not in w]:
        whole = w.pop(key)
        prefix = key[: -len(suffix.split(".", 1)[1])]  # the block's, e.g. ...self_attn.
        w[prefix + names[0]], w[prefix + names[1]] = whole[first], whole[second]
        del whole


def _bias(name: str) -> str:
    """The bias's name of a weight matrix's."""
    return name.removesuffix(".weight") + ".bias"


def _sub(w: dict[str, Array], prefix: str) -> dict[str, Array]:
    n = len(prefix)
    return {k[n:]: v for k, v in w.items() if k.startswith(prefix)}
