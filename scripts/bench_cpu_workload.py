"""The CPU-expert benchmarks' workload: random int8 or int4 layers of Qwen3-Next's width and
their routings (random, skewed, one expert, shared, none)."""

from __future__ import annotations

import numpy as np

from cpu_experts.shard import QuantizedLayer

H = 2048
ROWS = (1, 4, 8, 12, 16)


def random_layers(E: int, I: int, n_layers: int, seed: int,
                  fmt: str = "int8") -> dict[int, QuantizedLayer]:
    rng = np.random.default_rng(seed)

    def q(shape):  # the format's range: [-127, 127] (int8) or [-8, 7] (int4)
        raw = np.frombuffer(rng.bytes(int(np.prod(shape))), np.int8).reshape(shape)
        return raw >> 4 if fmt == "int4" else np.maximum(raw, np.int8(-127))

    table = (rng.random(4099, np.float32) * 1e-3 + 1e-4).astype(np.float16)

    def s(shape):  # scale values do not change the timing: tile a small random table
        return np.resize(table, shape)

    return {l: QuantizedLayer(q((E, I, H)), s((E, I, H // 32)), q((E, I, H)), s((E, I, H // 32)),
                              q((E, H, I)), s((E, H, I // 32))) for l in range(n_layers)}


def routings(kind: str, E: int, topk: int, rows: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "none":
        return [np.full((rows, topk), -1, np.int32) for _ in range(n)]
    if kind == "one_expert":
        return [np.full((rows, 1), rng.integers(E), np.int32) for _ in range(n)]
    if kind == "shared":  # every row on the same top-k experts (a fresh set per layer)
        return [np.tile(rng.choice(E, topk, replace=False), (rows, 1)).astype(np.int32)
                for _ in range(n)]
    p = None
    if kind == "skewed":  # Zipf-like popularity, a fresh ranking per layer
        p = 1.0 / np.arange(1, E + 1) ** 1.2
        p /= p.sum()
    out = []
    for _ in range(n):
        perm = rng.permutation(E)
        ids = np.stack([perm[rng.choice(E, topk, replace=False, p=p)] for _ in range(rows)])
        out.append(ids.astype(np.int32))
    return out
