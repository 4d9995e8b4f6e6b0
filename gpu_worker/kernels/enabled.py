"""Which of the GPU step's new CuPy kernels the model takes (issue 14, in progress).

A kernel is on by default once its tests have passed on a GPU: the first five passed on the
H200 (tree c3d793c, ``scripts/device_check.py --plan kernels,parity``), with the
batch-invariance test over 3,000 sampled layouts per architecture (all 18,320 at 917f870);
the last three at a016067 (``--plan graphs,kernels``, the same sample).
``TANDEM_GPU_KERNELS`` chooses another set (a comma list of names, ``all`` or ``none``);
``none`` is the earlier path (cuBLAS products of widened weights, attention and Gated
DeltaNet one segment at a time), kept to compare against.

* ``rowtile``: every dense product through gpu_worker/kernels/rowtile.py (model/ops.py)
* ``paged_attention``: one launch per layer for segments of <= 16 rows (model/attention.py)
* ``gdn``: the conv + delta-rule kernels of gpu_worker/kernels/gdn_recurrent.py (model/gdn.py)
* ``fused_norm``: RMSNorm in one launch, gpu_worker/kernels/fused_norm.py (model/ops.py)
* ``fused_silu``: SwiGLU's silu(gate) * up in one launch, gpu_worker/kernels/fused_silu.py
  (model/ops.py, the shared expert and dense MLP of model/moe.py)
* ``fused_sigmoid``: sigmoid(gate) * x in one launch (fused_silu.py's ``sigmoid_mul``): the
  output gates of attention and of the shared expert; with it Gated DeltaNet's
  ``o * silu(z)`` takes ``silu_mul`` too (about 700 fewer launches per step of the 80B), and
  with ``fused_norm`` and ``fused_silu`` also on, the norm before it and it are one launch
  (fused_norm.py's ``gated_rms_norm_rows``, the same bits)
* ``fused_router``: the router's softmax, top-k and weights in one launch,
  gpu_worker/kernels/router.py (model/moe.py ``route``; about eight fewer launches per MoE
  layer)
* ``fused_rope``: rotate-half RoPE of q and k in one launch each (fused_rope.py;
  about ten fewer launches per attention layer). With ``fused_norm`` on too, attention's q/k
  norms and RoPE are one launch, gpu_worker/kernels/qk_norm_rope.py (``Ops.qk_norm_rope``,
  the same bits: the two kernels' device functions; three fewer launches per attention layer)

The merged expert kernels and the sampler passed on the H200 and are not switched here.
"""

from __future__ import annotations

import functools
import os

KERNELS = ("rowtile", "paged_attention", "gdn", "fused_norm", "fused_silu", "fused_sigmoid",
           "fused_router", "fused_rope")
DEFAULT: frozenset[str] = frozenset(KERNELS)  # every one passed on the H200
ENV = "TANDEM_GPU_KERNELS"


def enabled(name: str) -> bool:
    """Whether the model takes kernel ``name`` (one of :data:`KERNELS`). Called per product
    and layer, so the variable's value is parsed once per distinct value."""
    if name not in KERNELS:
        raise KeyError(f"unknown GPU kernel {name!r} (have {', '.join(KERNELS)})")
    return name in _chosen(os.environ.get(ENV))


@functools.lru_cache(maxsize=8)
def _chosen(raw: str | None) -> frozenset[str]:
    """The kernels a value of :data:`ENV` turns on (None: :data:`DEFAULT`)."""
    if raw is None:
        return DEFAULT
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return frozenset(KERNELS) if "all" in names else frozenset(names)
