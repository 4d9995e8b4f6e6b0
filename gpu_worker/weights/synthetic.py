"""A synthetic weight source: the tensors of any config, made from a seed on the fly.

    SyntheticSource(config, seed=0).read("model.layers.3.mlp.experts.up_proj", np.float32,
                                         experts=[5, 9])  # -> [2, I, H]

Every tensor is cut into units along its first axis (one expert of a stacked expert tensor,
else blocks of about UNIT_ELEMS values); a unit's values come from NumPy's default generator
seeded by (seed, tensor name, unit), so reading experts [5, 9] gives exactly rows 5 and 9 of
reading all of them, in any order and any thread. Values are exactly representable in
bfloat16 (and float16, float32, float64): every storage dtype holds the same numbers.

Scales follow a trained model closely enough that activations stay finite through 48
layers: projections uniform with std 1/sqrt(fan_in) (on a grid of at most 511 levels, see
:func:`_grid`), norms neutral (1, or 0 where zero-centred), attention biases 0, GDN
``A_log`` / ``dt_bias`` / conv as transformers initialises them. The router's choice is
replaced by a :class:`gpu_worker.weights.routing.RoutingModel` (``source.routing``), since
random router rows pick experts uniformly and trained ones do not.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gpu_worker.model_config import ModelConfig
from gpu_worker.weights.routing import RoutingModel, RoutingParams
from gpu_worker.weights_spec import expected_tensors

Shape = tuple[int, ...]
UNIT_ELEMS = 1 << 22  # values per unit of a non-expert tensor (a row block)
STORAGE_ITEMSIZE = 2  # "stored" as bfloat16: nbytes() counts 2 bytes a value
# calibrated on models/tandem-tiny (docs/synthetic.md, scripts/calibrate_routing.py)
DEFAULT_ROUTING = RoutingParams(skew=0.66, locality=0.12)
_THREADS = min(16, os.cpu_count() or 1)


class SyntheticSource:
    """A :class:`gpu_worker.weights.source.WeightSource` of deterministic synthetic tensors.

    ``routing``: the routing knobs (None: :data:`DEFAULT_ROUTING`); the model built from this
    source routes with ``source.routing`` (None for a model without routed experts).
    """

    def __init__(self, config: ModelConfig, seed: int = 0, *,
                 routing: RoutingParams | None = None, include_mtp: bool = True) -> None:
        self.config = config
        self.path: Path | None = None
        self.seed = int(seed)
        self._shapes = expected_tensors(config, include_mtp=include_mtp)
        self.routing: RoutingModel | None = None
        if config.num_experts:
            self.routing = RoutingModel(config.num_experts, config.num_experts_per_tok,
                                        routing or DEFAULT_ROUTING, seed=self.seed)

    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def nbytes(self, name: str) -> int:
        return math.prod(self._shape(name)) * STORAGE_ITEMSIZE

    def read(self, name: str, dtype: np.dtype, *, experts: Sequence[int] | None = None
             ) -> np.ndarray:
        shape = self._shape(name)
        key = name
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            key = "model.embed_tokens.weight"  # tied: the same values
        if _is_stacked(name):
            units = list(range(shape[0])) if experts is None else [int(e) for e in experts]
            bad = [e for e in units if not 0 <= e < shape[0]]
            if bad:
                raise ValueError(f"{name}: expert ids {bad} out of range 0..{shape[0] - 1}")
            out = np.empty((len(units), *shape[1:]), dtype)
            jobs = [(out[i], u) for i, u in enumerate(units)]
        else:
            if experts is not None:
                raise ValueError(f"{name} is not a stacked expert tensor: experts must be None")
            out = np.empty(shape, dtype)
            rows = max(1, UNIT_ELEMS // max(1, math.prod(shape[1:]))) if shape else 1
            jobs = [(out[r:r + rows], r // rows) for r in range(0, shape[0], rows)] \
                if shape else [(out, 0)]
        gen = _Generator(self.seed, key, shape, self.config)
        # NOTE: threads of its own only for a read from the main thread (a dense tensor);
        # the loader's threads each read a run of experts already: a pool per run under
        # them would be up to 16 x 16 threads on 16 cores
        if (out.size > UNIT_ELEMS and len(jobs) > 1 and _THREADS > 1
                and threading.current_thread() is threading.main_thread()):
            with ThreadPoolExecutor(_THREADS) as pool:  # NumPy fills release the GIL
                list(pool.map(lambda job: gen.fill(*job), jobs))
        else:
            for job in jobs:
                gen.fill(*job)
        return out

    def _shape(self, name: str) -> Shape:
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"synthetic source: no tensor {name!r} in this config") from None


def _is_stacked(name: str) -> bool:
    return ".mlp.experts." in name


class _Generator:
    """Fills units of one tensor (``key`` names its values, ``shape`` its full shape)."""

    def __init__(self, seed: int, key: str, shape: Shape, cfg: ModelConfig) -> None:
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        self.words = [seed & 0xFFFFFFFF, seed >> 32] + [
            int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
        self.kind, self.value = _init_kind(key, shape, cfg)

    def fill(self, out: np.ndarray, unit: int) -> None:
        """Unit ``unit`` (one expert, or one block of rows) into ``out``."""
        if self.kind == "const":
            out[...] = self.value
            return
        rng = np.random.default_rng([*self.words, unit])
        n = out.size
        if self.kind == "uniform":
            half, scale = _grid(self.value)
            ints = rng.integers(-half, half + 1, n, dtype=np.int16)
            if out.dtype == np.float32 and out.flags.c_contiguous:  # no float temporary
                np.multiply(ints.reshape(out.shape), np.float32(scale), out=out)
                return
            vals = ints.astype(np.float32)
            vals *= np.float32(scale)  # exact: |ints| < 256 and scale a power of two
        elif self.kind == "A_log":  # A uniform in [1, 16) like transformers' init
            vals = _bf16_round(np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32))
        else:  # dt_bias: inverse softplus of dt log-uniform in [1e-3, 1e-1]
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
            vals = _bf16_round(np.log(np.expm1(dt)).astype(np.float32))
        out[...] = vals.reshape(out.shape)


def _init_kind(name: str, shape: Shape, cfg: ModelConfig) -> tuple[str, float]:
    if name.endswith("linear_attn.norm.weight"):  # the gated norm: plain weight
        return "const", 1.0
    if name.endswith("norm.weight"):  # zero-centred (1 + w) in Qwen3-Next, plain in MoE
        return "const", 0.0 if cfg.zero_centered_norms else 1.0
    if name.endswith(".bias"):
        return "const", 0.0
    if name.endswith(".A_log"):
        return "A_log", 0.0
    if name.endswith(".dt_bias"):
        return "dt_bias", 0.0
    if name.endswith("conv1d.weight"):  # PyTorch's U(+-1/sqrt(K)): std 1/sqrt(3K)
        return "uniform", 1.0 / math.sqrt(3 * shape[-1])
    return "uniform", 1.0 / math.sqrt(shape[-1])  # fan_in: the last axis


def _grid(std: float) -> tuple[int, float]:
    """(n, 2**e) with n in [128, 255] such that the uniform integers -n..n times 2**e have
    standard deviation ``std`` (within 0.5 %): n(n + 1)/3 = (std / 2**e)**2. The products
    have at most 8 significant bits, so bfloat16 holds them exactly."""
    e = math.floor(math.log2(std / math.sqrt(128 * 129 / 3)))
    t = std / 2.0 ** e
    n = round((-1 + math.sqrt(1 + 12 * t * t)) / 2)
    return min(255, max(128, n)), 2.0 ** e


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 value (ties to even), still float32."""
    u = x.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    u &= np.uint32(0xFFFF0000)
    return x
