"""Feed-forward blocks: top-k softmax router, SwiGLU experts, shared expert, dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_worker.kernels import router, topk
from gpu_worker.kernels.enabled import enabled
from gpu_worker.kernels.int8_stack import Int8Stack
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig
from gpu_worker.routed_experts import Quantized, RoutedExperts

if TYPE_CHECKING:
    from gpu_worker.weights.routing import RowRouting

# CuPy: the expert kernels (which never wait for the host) take at most this many rows per
# call (the default prefill chunk): a larger pass (a full prefill chunk beside other slots'
# decode rows) runs them over consecutive row blocks, so their scratch (rows x top-k x
# (H + I) values) stays bounded and a row keeps its bits. (Until tree d9e0453 such a pass
# took the per-expert loop, whose sums run in another order: a prompt's rows then changed
# with what shared its step.) The merged kernels (gpu_worker/kernels/moe_merged.py) read each
# expert's weights once for all its rows; the grouped ones (moe_experts.py: every (row,
# expert) pair alone, the weights read once per pair) stay for comparison
# (docs/gpu_experts.md, scripts/bench_experts_gpu.py).
GROUPED_MAX_ROWS = 512
# a layer's router and shared-expert projections stacked in one matrix (model.stack_inputs)
IN_STACK = "router_shared_stack"
IN_STACK_PARTS = ("gate.weight", "shared_expert.gate_proj.weight",
                  "shared_expert.up_proj.weight", "shared_expert_gate.weight")
GPU_EXPERT_KERNELS = "merged"  # or "grouped"


def route(ops: Ops, cfg: ModelConfig, w_gate: Array, x: Array,
          chosen: Array | None = None, logits: Array | None = None) -> tuple[Array, Array]:
    """Router: softmax over all experts, top-k, optional renormalisation.
    Returns expert ids [R, k] (int64) and weights [R, k]. ``chosen`` (int64 [R, k], e.g. a
    synthetic model's routing model) replaces the top-k; the weights are still the softmax
    gathered at those ids. CuPy float32 with ``fused_router`` on: one launch either way
    (gpu_worker/kernels/router.py, its own softmax bits)."""
    xp = ops.xp
    if logits is None:  # else made already (the layer's stacked input product)
        logits = ops.linear(x, w_gate)  # [R, E]
    ids = None if chosen is None else xp.asarray(chosen, dtype=xp.int64)  # [R, k]
    if (xp.__name__ == "cupy" and logits.dtype == xp.float32
            and logits.shape[-1] <= router.MAX_EXPERTS and enabled("fused_router")):
        if ids is None:
            return router.router_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return ids, router.router_given(logits, ids, cfg.norm_topk_prob)
    probs = ops.softmax(logits, axis=-1)  # [R, E]
    if ids is None and (xp.__name__ == "cupy" and probs.dtype == xp.float32
                        and probs.shape[-1] <= topk.MAX_EXPERTS):
        ids = topk.topk_rows(probs, cfg.num_experts_per_tok)  # argsort's ids, no host sync
    elif ids is None:
        kwargs = {"kind": "stable"} if xp.__name__ == "numpy" else {}
        ids = xp.argsort(-probs, axis=-1, **kwargs)[:, : cfg.num_experts_per_tok]  # [R, k]
    weights = xp.take_along_axis(probs, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def swiglu(ops: Ops, x: Array, gate: Array, up: Array, down: Array) -> Array:
    """down(silu(gate x) * up x): x [n, H] -> [n, H]."""
    return ops.linear(ops.silu_mul(ops.linear(x, gate), ops.linear(x, up)), down)


def expert_stacks(mlp: dict[str, Array]) -> tuple[Array, Array, Array]:
    """A MoE layer's stacked experts: gate [E, I, H], up [E, I, H], down [E, H, I]."""
    return mlp["experts.gate_proj"], mlp["experts.up_proj"], mlp["experts.down_proj"]


def experts_local(ops: Ops, gate: Array, up: Array, down: Array, x: Array,
                  ids: Array, weights: Array) -> Array:
    """sum_k w_k * expert_{ids_k}(x) per row, experts stacked [E, I, H] / [E, H, I].

    Pairs with id -1 are skipped (computed elsewhere, e.g. on CPU workers).
    NOTE: a row's sum never depends on the batch: on NumPy (the loop below) each row
    accumulates its experts in ascending expert id; on CuPy, batches of up to
    rows, in blocks of at most :data:`GROUPED_MAX_ROWS`, take the kernels of
    :data:`GPU_EXPERT_KERNELS`, which never wait for the host: ``merged`` sums in slot order
    (gpu_worker/kernels/moe_merged.py), ``grouped`` in ascending id (moe_experts.py).
    """
    xp = ops.xp
    if xp.__name__ != "cupy" or x.shape[0] == 0:
        return experts_loop(ops, gate, up, down, x, ids, weights)
    if GPU_EXPERT_KERNELS == "grouped":
        from gpu_worker.kernels.moe_experts import experts_grouped as kernels  # noqa: PLC0415
    else:
        from gpu_worker.kernels.moe_merged import experts_merged as kernels  # noqa: PLC0415
    R = x.shape[0]
    if R <= GROUPED_MAX_ROWS:
        return kernels(x, ids, weights, gate, up, down)
    out = xp.empty_like(x)
    for a in range(0, R, GROUPED_MAX_ROWS):
        b = slice(a, min(a + GROUPED_MAX_ROWS, R))
        out[b] = kernels(x[b], ids[b], weights[b], gate, up, down)
    return out


def experts_loop(ops: Ops, gate: Array, up: Array, down: Array, x: Array,
                 ids: Array, weights: Array) -> Array:
    """:func:`experts_local` as one matrix product per distinct expert, in ascending id."""
    xp = ops.xp
    out = xp.zeros_like(x)
    flat_ids = ids.reshape(-1)
    for e in [int(e) for e in xp.unique(flat_ids) if e >= 0]:
        rows, slots = xp.nonzero(ids == e)  # one (row, k) pair per routed row
        y = swiglu(ops, x[rows], *(_expert(ops, a, e) for a in (gate, up, down)))  # [n, H]
        out[rows] += weights[rows, slots][:, None] * y
    return out


def _expert(ops: Ops, stack: Array, e: int) -> Array:
    """Expert ``e``'s matrix of a stack; an int8 stack's as its exact values in the compute
    dtype (gpu_worker/kernels/int8_stack.py)."""
    return stack.expert(e, ops.dtype) if isinstance(stack, Int8Stack) else stack[e]


def sparse_moe(ops: Ops, cfg: ModelConfig, p: dict[str, Array], x: Array,
               experts: RoutedExperts | None = None, layer: int = -1,
               quant: Quantized | None = None, routing: RowRouting | None = None,
               live: Array | None = None) -> Array:
    """Qwen3 sparse MoE block of layer ``layer``; Qwen3-Next adds the sigmoid-gated shared
    expert. ``experts`` computes the routed part (``quant``: ``x`` quantized by its
    ``moe_norm``); None runs all experts here. ``routing`` (synthetic models) picks the
    experts of every row instead of the router's top-k. ``live`` (bool [R]): rows where it
    is False pick no routed expert (id -1: a padded pass's padding, gpu_worker/
    graph_buckets.py), so they read no expert weights on the GPU or the CPU."""
    chosen = None if routing is None else routing.ids(layer)
    has_shared = "shared_expert.gate_proj.weight" in p
    logits = None
    if has_shared:  # router, shared gate, shared up, shared sigmoid gate (one launch stacked)
        logits, s_gate, s_up, s_sigmoid = ops.linear_parts(x, p, IN_STACK_PARTS, IN_STACK)
    ids, weights = route(ops, cfg, p["gate.weight"], x, chosen, logits)  # [R, k], [R, k]
    if live is not None:
        ids = ops.xp.where(live[:, None], ids, -1)
    shared = []

    def shared_expert() -> None:  # swiglu of the products made above
        shared.append(ops.linear(ops.silu_mul(s_gate, s_up),
                                 p["shared_expert.down_proj.weight"]))

    if experts is None:
        out = experts_local(ops, *expert_stacks(p), x, ids, weights)
        if has_shared:
            shared_expert()
    else:  # the shared expert runs on the GPU while the CPU experts do
        out = experts(layer, x, ids, weights, quant, shared_expert if has_shared else None)
    if has_shared:
        out = ops.sigmoid_mul_add(s_sigmoid, shared[0], out)  # out + sigmoid(g) * shared
    return out


def dense_mlp(ops: Ops, p: dict[str, Array], x: Array) -> Array:
    return swiglu(ops, x, p["gate_proj.weight"], p["up_proj.weight"], p["down_proj.weight"])
