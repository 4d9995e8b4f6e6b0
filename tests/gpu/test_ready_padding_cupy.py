"""READY's ``ModelInfo.padded_passes`` (gpu_worker/server.build_runner): true where the
worker's CUDA graphs pad passes up to their capacity buckets, which the daemon's adaptive
budget then prices (protocol.worker_config.padded_rows); false without buckets or graphs."""

from __future__ import annotations

import pytest

from gpu_worker.server import build_runner
from protocol.worker_config import WorkerConfig
from scripts.tiny_model import make_tiny_model

pytest.importorskip("cupy")


@pytest.mark.parametrize(("graphs", "buckets", "padded"),
                         [(True, True, True), (True, False, False), (False, True, False)])
def test_ready_says_whether_passes_are_padded(tmp_path, graphs, buckets, padded):
    model = make_tiny_model(tmp_path / "m", "qwen3_next", seed=3)
    cfg = WorkerConfig(run_dir=str(tmp_path / "run"), model=str(model), backend="cupy",
                       max_slots=2, max_context=128, block_size=16, cuda_graphs=graphs,
                       graph_buckets=buckets, graph_warm_up="decode")
    runner, pool, info = build_runner(cfg)
    assert pool is None and info.padded_passes is padded
    assert (runner.graphs is not None) is graphs
