"""gpu_worker.memory_plan: bytes counted by hand on a tiny config and against real arrays, the
CPU format against cpu_experts' own layout, the split the budget decides, and refusals."""

from __future__ import annotations

import inspect
import json
import math
import re
import struct

import numpy as np
import pytest

from cpu_experts import shard
from daemon.prefix_cache import PrefixCache
from gpu_worker.engine import Engine
from gpu_worker.memory_plan import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    PlanError,
    describe,
    plan_for_worker,
    plan_memory,
)
from gpu_worker.model_config import ModelConfig
from protocol.worker_config import GIB, MAX_PREFIX_ENTRIES, WorkerConfig
from scripts.tiny_model import make_tiny_model
from tests.qwen3_next_80b import QWEN3_NEXT_80B

# H=64 V=128; layers 1, 3 full attention, 0, 2 GDN; layer 0 a dense MLP, 1-3 sparse; MTP head
TINY = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 32, "mlp_only_layers": [0],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 4096}
SETTINGS = dict(dtype="float32", max_slots=2, max_context=100, kv_block_size=16,
                prefill_chunk=32, prefix_cache_mb=1, host_available_bytes=None)


def _tiny() -> ModelConfig:
    return ModelConfig.from_dict(TINY)


def test_dense_parts_kv_states_and_work_space_match_a_hand_count():
    plan = plan_memory(_tiny(), backend="numpy", placement="gpu", **SETTINGS)
    attention = 128 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16  # q (gated) k v o, q/k norms
    gdn = 192 * 64 + 8 * 64 + 128 * 4 + 4 + 4 + 16 + 64 * 64  # qkvz ba conv dt A norm out
    shared = 3 * 32 * 64 + 64
    experts = 8 * 3 * 32 * 64
    mtp = 64 * 128 + 2 * 64 + attention + 8 * 64 + experts + shared + 2 * 64 + 64
    assert dict(plan.dense_parts) == {
        "embeddings": 128 * 64 * 4, "lm_head": 128 * 64 * 4, "attention": 2 * attention * 4,
        "GDN": 2 * gdn * 4, "norms": (4 * 2 * 64 + 64) * 4, "routers": 3 * 8 * 64 * 4,
        "shared experts": 3 * shared * 4, "dense MLPs": 3 * 96 * 64 * 4, "MTP head": mtp * 4}
    assert plan.moe_layers == (1, 2, 3) and plan.gpu_bytes_per_expert == 3 * 32 * 64 * 4
    assert plan.gpu_expert_bytes == 3 * experts * 4
    # KV: 2 full layers + MTP's, K and V, 16 tokens, 2 heads of 16 float32
    assert plan.kv_block_bytes == 2 * 3 * 16 * 2 * 16 * 4
    prefix = min(2**20 // plan.kv_block_bytes, 4 * 7 * 2)  # 1 MiB, capped at 4 slots' worth
    assert (plan.kv_prefix_blocks, plan.kv_blocks) == (prefix, 2 * 7 + prefix)
    assert plan.gdn_state_bytes_per_slot == 2 * (4 * 16 * 16 + 3 * 128) * 4
    # one state copy per entry; entries pin a block each at least, all within 1 MiB
    assert plan.prefix_snapshots == 2**20 // (plan.kv_block_bytes + plan.gdn_state_bytes_per_slot)
    assert plan.speculation_bytes == 0
    assert dict(plan.work_parts) == {
        "activations": 8 * (2 * 32) * 192 * 4,  # two slots' prefill chunks
        "attention scores": 3 * 4 * 32 * 100 * 4 + 2 * 100 * 2 * 16 * 4
        + 2 * 1 * (100 // 64 + 1) * 4 * (16 + 2) * 4,  # paged attention's partitions
        "logits": 2 * 2 * 128 * 4, "expert scratch": 64 * 2 * (64 + 2 * 32) * 4,
        "bf16 widening": 0}
    assert (plan.allocator_slack_bytes, plan.cuda_context_bytes) == (0, 0)  # NumPy


def test_bf16_halves_the_matrices_and_keeps_vectors_float32():
    f32 = plan_memory(_tiny(), backend="numpy", placement="gpu", **SETTINGS)
    bf16 = plan_memory(_tiny(), backend="numpy", placement="gpu", **{**SETTINGS,
                                                                     "dtype": "bfloat16"})
    assert dict(bf16.dense_parts)["norms"] == dict(f32.dense_parts)["norms"]
    assert dict(bf16.dense_parts)["lm_head"] * 2 == dict(f32.dense_parts)["lm_head"]
    assert bf16.gpu_bytes_per_expert * 2 == f32.gpu_bytes_per_expert
    assert bf16.kv_cache_bytes == f32.kv_cache_bytes  # "model" KV: the float32 compute dtype
    assert dict(bf16.work_parts)["bf16 widening"] == 192 * 64 * 4  # in_proj_qkvz, the largest


def _checkpoint_bytes(path) -> int:
    """Every tensor's bytes in the checkpoint's safetensors headers (read here, by hand)."""
    total = 0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for k, t in header.items() if k != "__metadata__")
    return total


@pytest.mark.parametrize("arch, tied", [("qwen3_next", False), ("qwen3_next", True),
                                        ("qwen3_moe", False)])
def test_plan_counts_what_the_model_really_holds(tmp_path, arch, tied):
    """The checkpoint's bytes (a tied lm_head is not on disk, and goes once to the GPU)."""
    path = make_tiny_model(tmp_path, arch, seed=0, tokenizer=False, tie_embeddings=tied)
    config = ModelConfig.from_file(path / "config.json")
    plan = plan_memory(config, backend="numpy", placement="gpu",
                       **{**SETTINGS, "max_context": 40, "prefix_cache": False})
    assert plan.dense_bytes + plan.gpu_expert_bytes == _checkpoint_bytes(path)
    engine = Engine.from_dir(path, max_slots=2, max_len=40, block_size=16)
    caches = engine.caches
    assert plan.kv_cache_bytes == caches.kv.nbytes
    states = 0 if caches.states is None else caches.states.conv.nbytes + caches.states.rec.nbytes
    assert plan.gdn_state_bytes == states


@pytest.mark.parametrize("workers", [1, 2])
def test_cpu_bytes_are_the_workers_shared_memory(workers):
    config = ModelConfig.from_dict({**TINY, "moe_intermediate_size": 96})  # 3 blocks of 32
    plan = plan_memory(config, backend="numpy", placement="cpu", cpu_workers=workers,
                       **SETTINGS)
    layer = shard.LayerShape(8, 96, 64)
    bounds = shard.shard_bounds(96, workers)
    exact = sum(shard.plan_shard({i: layer for i in plan.moe_layers},
                                 {i: bounds[w] for i in plan.moe_layers})[1]
                for w in range(workers))
    assert exact <= plan.cpu_expert_bytes <= exact + 3 * 2 * workers * 64
    assert plan.cpu_bytes_per_expert == 3 * 96 * 64 * 36 / 32  # int8 + a float32 per 32


def _fitting_budget(n: int) -> int:
    """The smallest CuPy budget that holds ``n`` experts per layer of the tiny model."""
    probe = plan_memory(_tiny(), backend="cupy", placement="cpu", **SETTINGS)
    arrays = probe.gpu_fixed_bytes + n * 3 * probe.gpu_bytes_per_expert
    return arrays + math.ceil(ALLOCATOR_SLACK * arrays) + CUDA_CONTEXT


def test_split_keeps_as_many_experts_as_fit_and_no_more():
    budget = _fitting_budget(5)
    plan = plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=budget, **SETTINGS)
    assert (plan.experts_gpu_per_layer, plan.experts_cpu_per_layer) == (5, 3)
    assert plan.placement == "split" and plan.gpu_total_bytes <= budget
    assert plan.gpu_expert_ids(2) == (0, 1, 2, 3, 4) and plan.cpu_expert_ids(2) == (5, 6, 7)
    fewer = plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=budget - 1, **SETTINGS)
    assert fewer.experts_gpu_per_layer == 4
    roomy = plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=10 * budget, **SETTINGS)
    assert (roomy.experts_gpu_per_layer, roomy.placement) == (8, "gpu")
    assert roomy.cpu_expert_bytes == 0


def test_the_hottest_experts_stay_on_the_gpu():
    counts = {i: np.array([5, 90, 1, 70, 3, 60, 2, 80]) for i in (1, 2, 3)}
    plan = plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=_fitting_budget(3),
                       hot_counts=counts, **SETTINGS)
    assert plan.gpu_expert_ids(1) == (1, 7, 3)
    assert set(plan.cpu_expert_ids(3)) == {0, 2, 4, 5, 6}


def test_an_explicit_cpu_count_wins_when_it_fits_and_is_refused_when_not():
    budget = _fitting_budget(5)
    plan = plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=budget,
                       cpu_experts_per_layer=6, **SETTINGS)
    assert plan.experts_gpu_per_layer == 2
    with pytest.raises(PlanError, match=r"cpu_experts_per_layer = 1 leaves 7 experts"):
        plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=budget,
                    cpu_experts_per_layer=1, **SETTINGS)


def _over(message: str) -> tuple[float, float, float]:
    """(needed, over, budget) in MiB from a refusal's first words."""
    m = re.match(r"needs ([\d.]+) MiB of GPU memory, ([\d.]+) MiB over the ([\d.]+) MiB", message)
    assert m, message
    return tuple(float(g) for g in m.groups())


def test_refusals_say_by_how_much():
    budget = _fitting_budget(5)
    with pytest.raises(PlanError) as info:
        plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=budget, placement="gpu",
                    **SETTINGS)
    need, over, have = _over(str(info.value))
    total = info.value.plan.gpu_total_bytes
    assert need == round(total / 2**20, 1) and have == round(budget / 2**20, 1)
    assert over == round((total - budget) / 2**20, 1) and over > 0
    assert "placement 'gpu' keeps all 8 experts of 3 layers" in str(info.value)
    with pytest.raises(PlanError, match="lower scheduler.max_slots") as info:
        plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=_fitting_budget(0) - 1,
                    **SETTINGS)
    assert _over(str(info.value))[1] == 0.0  # one byte over
    with pytest.raises(PlanError, match=r"GiB of host RAM .* over the 3\.0 GiB available"):
        plan_memory(_tiny(), backend="numpy", placement="cpu",
                    **{**SETTINGS, "host_available_bytes": 3 * GIB})


@pytest.mark.parametrize("mb", [1, 64])
def test_prefix_blocks_and_entries_agree_with_the_worker_and_the_daemon(mb):
    cfg = WorkerConfig(run_dir="/r", model="/m", max_slots=2, max_context=100, block_size=16,
                       prefix_cache_max_mb=mb)
    plan = plan_memory(_tiny(), backend="numpy", placement="gpu",
                       **{**SETTINGS, "prefix_cache_mb": mb})
    assert plan.kv_prefix_blocks == cfg.prefix_blocks(plan.kv_block_bytes)
    default = inspect.signature(PrefixCache).parameters["max_entries"].default
    assert default == MAX_PREFIX_ENTRIES
    # the daemon's cache, bounded as lifecycle.py bounds it, fed one-block checkpoints
    cache = PrefixCache(plan.kv_prefix_blocks, 16, block_bytes=plan.kv_block_bytes,
                        state_bytes=plan.gdn_state_bytes_per_slot, max_bytes=mb * 2**20)
    most = 0
    for i in range(600):
        cache.add([i] * 16, i)
        most = max(most, len(cache))
    assert most == plan.prefix_snapshots


def test_the_worker_config_maps_onto_the_plan():
    cfg = WorkerConfig(run_dir="/r", model="/m", dtype="float32", max_slots=2, max_context=100,
                       block_size=16, prefix_cache_max_mb=1, prefill_chunk=32, max_drafts=2,
                       placement="split", gpu_memory_gb=_fitting_budget(5) / GIB,
                       cpu_workers=2, cuda_graphs=False)
    plan = plan_for_worker(cfg, _tiny(), backend="cupy", host_available_bytes=None)
    assert plan == plan_memory(_tiny(), backend="cupy", gpu_budget_bytes=cfg.gpu_budget_bytes,
                               max_drafts=2, cpu_workers=2, **SETTINGS)
    assert plan.experts_gpu_per_layer < 5  # the drafts' rows and states took room


def test_speculation_keeps_every_draft_rows_state():
    plan = plan_memory(_tiny(), backend="numpy", placement="gpu",
                       **{**SETTINGS, "max_drafts": 3})
    assert plan.speculation_bytes == 2 * 4 * 2 * (4 * 16 * 16) * 4  # slots x rows x layers


# ---- the real size: Qwen3-Next-80B-A3B ----------------------------------------------------------
SERVE_80B = dict(dtype="bfloat16", backend="cupy", max_slots=4, max_context=32768,
                 kv_block_size=64, prefill_chunk=512, prefix_cache_mb=1024, cpu_workers=2,
                 host_available_bytes=None)


def test_qwen3_next_80b_on_32_gib_keeps_a_few_dozen_experts_per_layer():
    config = ModelConfig.from_dict(QWEN3_NEXT_80B)
    plan = plan_memory(config, gpu_budget_bytes=32 * GIB, **SERVE_80B)
    assert len(plan.moe_layers) == 48 and plan.num_experts == 512
    assert plan.gpu_bytes_per_expert == 3 * 512 * 2048 * 2  # 6 MiB in bf16
    assert 6.5 * GIB < plan.dense_bytes < 8 * GIB  # 3.0 GiB of it: the MTP head's experts
    assert 20 <= plan.experts_gpu_per_layer <= 60, describe(plan)
    assert plan.gpu_total_bytes <= 32 * GIB


def test_qwen3_next_80b_one_more_expert_does_not_fit_32_gib():
    config = ModelConfig.from_dict(QWEN3_NEXT_80B)
    plan = plan_memory(config, gpu_budget_bytes=32 * GIB, **SERVE_80B)
    with pytest.raises(PlanError, match="over the 32.0 GiB budget"):
        plan_memory(config, gpu_budget_bytes=32 * GIB,
                    cpu_experts_per_layer=plan.experts_cpu_per_layer - 1, **SERVE_80B)
    assert 70 * GIB < plan.cpu_expert_bytes < 80 * GIB  # int8 + scales of ~470 per layer


def test_qwen3_next_80b_on_a_whole_h200_keeps_most_experts():
    config = ModelConfig.from_dict(QWEN3_NEXT_80B)
    plan = plan_memory(config, gpu_budget_bytes=140 * GIB, **SERVE_80B)
    assert 380 <= plan.experts_gpu_per_layer <= 420, describe(plan)
    assert plan.placement == "split" and plan.gpu_total_bytes <= 140 * GIB


def test_cuda_graphs_are_counted_on_cupy_only():
    """The graphs' pool reserve and shared logits/hidden rows (gpu_worker/step_graph.py)
    enter the work space, and a 32 GiB plan keeps fewer experts on the GPU for them."""
    from gpu_worker.memory_parts import GRAPH_POOL_RESERVE

    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    kw = dict(gpu_budget_bytes=32 * GIB, max_drafts=4, host_available_bytes=None)
    plain = plan_memory(cfg, **kw)
    graphs = plan_memory(cfg, cuda_graphs=True, **kw)
    part = dict(graphs.work_parts)["CUDA graphs"]
    assert part == GRAPH_POOL_RESERVE + 4 * 5 * (cfg.vocab_size + cfg.hidden_size) * 4
    assert graphs.work_bytes == plain.work_bytes + part
    assert graphs.experts_gpu_per_layer < plain.experts_gpu_per_layer
    on_numpy = plan_memory(cfg, backend="numpy", cuda_graphs=True, **kw)
    assert "CUDA graphs" not in dict(on_numpy.work_parts)
