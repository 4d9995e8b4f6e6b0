"""The memory plan against what a CuPy model really allocates, and the device's size."""

from __future__ import annotations

import gc

import pytest

from gpu_worker.engine import Engine
from gpu_worker.memory_parts import device_memory_bytes
from gpu_worker.memory_plan import plan_memory
from gpu_worker.model_config import ModelConfig
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


def test_the_whole_device_is_what_cuda_reports():
    total = device_memory_bytes()
    assert total == cupy.cuda.runtime.memGetInfo()[1] and total > 2**30


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plan_matches_the_pool_after_loading(tmp_path, arch, dtype):
    """Weights + KV + GDN states in CuPy's pool equal the plan's bytes (the pool rounds each
    allocation up to 512 bytes; small tables such as RoPE's may add a little)."""
    if "cpu-emulator" in cupy.__version__:
        pytest.skip("the emulator's arrays are NumPy's: no memory pool to measure")
    path = make_tiny_model(tmp_path, arch, seed=0, tokenizer=False, hidden=256, experts=16)
    config = ModelConfig.from_file(path / "config.json")
    plan = plan_memory(config, dtype=dtype, backend="cupy", placement="gpu", max_slots=2,
                       max_context=256, kv_block_size=16, prefix_cache=False,
                       host_available_bytes=None)
    pool = cupy.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before = pool.used_bytes()
    engine = Engine.from_dir(path, dtype=dtype, backend="cupy", max_slots=2, max_len=256,
                             block_size=16)
    gc.collect()
    used = pool.used_bytes() - before
    want = plan.dense_bytes + plan.gpu_expert_bytes + plan.kv_cache_bytes + plan.gdn_state_bytes
    assert want <= used <= want * 1.02 + 2**20, (want, used)
    del engine
