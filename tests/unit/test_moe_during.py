"""The shared expert is the GPU's work while the CPU experts run: the model hands it to the
routed experts as ``during`` (gpu_worker/routed_experts.py), which enqueue it once per MoE
layer before waiting for the CPU workers; the logits are those of computing it afterwards."""

from __future__ import annotations

import numpy as np

from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model


def test_the_shared_expert_runs_while_the_cpu_experts_do(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=3, tokenizer=False)
    ids = np.arange(4, 24) * 11 % 500
    engine = Engine.from_dir(path, placement="split", cpu_experts_per_layer=4, cpu_workers=1,
                             max_slots=1, max_len=64)
    try:
        placement = engine.placement
        plain = engine.score(ids)
        events: list[tuple[str, int]] = []
        inner = placement.path.__class__.__call__
        pool = placement.path.pool

        def path_call(self, layer, x, ids_, weights, quant, during=None):
            assert during is not None, "a Qwen3-Next MoE layer has a shared expert"

            def marked() -> None:
                events.append(("shared", layer))
                during()

            return inner(self, layer, x, ids_, weights, quant, marked)

        for name in ("dispatch", "dispatch_quantized"):
            original = getattr(pool, name)

            def dispatch(layer, *args, _original=original, **kwargs):
                events.append(("cpu", layer))
                return _original(layer, *args, **kwargs)

            monkeypatch.setattr(pool, name, dispatch)
        monkeypatch.setattr(placement.path.__class__, "__call__", path_call)
        again = engine.score(ids)
    finally:
        engine.close()
    assert again.tobytes() == plain.tobytes()
    layers = engine.model.cfg.num_hidden_layers
    shared = [e for e in events if e[0] == "shared"]
    assert len(shared) == layers, events
    for layer in range(layers):  # per layer: the shared expert enqueued, then the CPU's part
        at = events.index(("shared", layer))
        assert events[at + 1] == ("cpu", layer), events
