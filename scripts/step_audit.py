"""What stands between the worker's step and a CUDA graph, measured on the CPU emulator's fake
CuPy (scripts/cuda_emu/audit.py): one decode step and one wide verify step of a tiny bf16
model, run by ``Runner.execute`` exactly as served (forward, sampling, sample-and-match),
with the new kernels on and off.

    python -m scripts.step_audit [--arch qwen3_next|qwen3_moe] [--slots 4 --rows 5]

Printed per step: launches (total, per part of the step, per layer of each kind), every
device->host transfer or sync and every host->device upload grouped by the worker line that
caused it, and the allocations. docs/gpu_step.md ("What stood between the step and a CUDA
graph") turned this into the work list.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
from typing import Any

import numpy as np

from scripts.cuda_emu.audit import Audit, audit

ARCHS = ("qwen3_next", "qwen3_moe")
# as tests/gpu/test_batch_invariance_cupy.py: qwen3_next one GDN and one attention layer,
# qwen3_moe one attention layer; every layer a sparse MoE; no MTP head
SIZES = {"qwen3_moe": {"layers": 1, "mtp": False},
         "qwen3_next": {"layers": 2, "full_attention_interval": 2, "mtp": False}}
PROMPT = 14  # tokens prefilled per slot: the verify chain (15..) crosses into a second KV block
KERNEL_ENV = "TANDEM_GPU_KERNELS"


@contextlib.contextmanager
def fake_cupy():
    """``import cupy`` gives the emulator's fake inside the block (as the pytest plugin,
    scripts/cuda_emu/plugin.py, does for a whole run); the real one, if any, after it. The
    worker's kernel modules keep what they compiled: run this in a process of its own."""
    from scripts.cuda_emu import fake_cupy as fc  # noqa: PLC0415

    saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda")}
    name, fc.__name__ = fc.__name__, "cupy"
    sys.modules["cupy"], sys.modules["cupy.cuda"] = fc, fc.cuda
    try:
        yield fc
    finally:
        fc.__name__ = name
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def build_runner(arch: str, slots: int, rows: int, tmp: str) -> Any:
    """A Runner over a tiny bf16 model of ``arch`` on the fake CuPy (every expert on it)."""
    import cupy  # noqa: PLC0415  (the fake)

    from gpu_worker.kernels.bf16 import BF16  # noqa: PLC0415
    from gpu_worker.loader import load_checkpoint  # noqa: PLC0415
    from gpu_worker.model.model import Model  # noqa: PLC0415
    from gpu_worker.runner import Runner  # noqa: PLC0415
    from scripts.tiny_model import make_tiny_model  # noqa: PLC0415

    path = make_tiny_model(tmp, arch, seed=14, tokenizer=False, **SIZES[arch])
    ckpt = load_checkpoint(path, dtype=np.float32)
    model = Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16)
    return Runner(model, max_slots=slots, max_context=PROMPT + rows + 16)


def _work(slot: int, start: int, tokens: np.ndarray, drafts: np.ndarray, kind) -> Any:
    from protocol.messages import DraftSource, SamplingParams, SlotWork  # noqa: PLC0415

    return SlotWork(slot=slot, request_id=f"r{slot}", kind=kind, input_ids=tokens,
                    start_pos=start, num_tokens=len(tokens), prompt_len=PROMPT,
                    needs_logits=True, sampling=SamplingParams(temperature=0.8, top_p=0.9,
                                                               seed=slot),
                    draft_ids=drafts, draft_sources=np.full(len(drafts), DraftSource.SUFFIX,
                                                            np.uint8))


def audit_steps(arch: str, slots: int, rows: int, kernels: str = "all"
                ) -> dict[str, tuple[Audit, int]]:
    """{"decode": (audit, rows), "verify": (audit, rows)} of one decode step (one token per
    slot) and one wide verify step (a token and ``rows - 1`` drafts per slot) after every
    slot's prefill; ``kernels``: TANDEM_GPU_KERNELS for the run."""
    from protocol.messages import CacheOp, CacheOpKind, StepPlan, WorkKind  # noqa: PLC0415

    saved = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = kernels
    rng = np.random.default_rng(0)
    try:
        with fake_cupy(), tempfile.TemporaryDirectory() as tmp:
            runner = build_runner(arch, slots, rows, tmp)
            vocab = runner.model.cfg.vocab_size
            ids = lambda n: rng.integers(0, vocab, n).astype(np.int32)  # noqa: E731
            none = np.zeros(0, np.int32)
            for s in range(slots):  # the prefill: not audited
                runner.execute(StepPlan(step_id=s, slots=[_work(s, 0, ids(PROMPT), none,
                                                                  WorkKind.PREFILL)],
                                        cache_ops=[CacheOp(op=CacheOpKind.ALLOCATE, slot=s)]))
            out = {}
            for name, drafts in (("decode", 0), ("verify", rows - 1)):
                work = [_work(s, runner.lengths[s], ids(1), ids(drafts), WorkKind.DECODE)
                        for s in range(slots)]
                with audit() as a:
                    runner.execute(StepPlan(step_id=100 + len(out), slots=work, wide=True))
                out[name] = (a, slots * (1 + drafts))
            out["layers"] = collections.Counter(  # kind -> layers of the model
                "attention" if la.full else "gdn" for la in runner.model.layers)
            return out
    finally:
        if saved is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = saved


def report(title: str, a: Audit, rows: int, layers: collections.Counter) -> str:
    """The printed record of one audited step."""
    per_layer = {"attention": layers["attention"], "gdn": layers["gdn"],
                 "moe": sum(layers.values()), "layer norms/residuals": sum(layers.values())}
    lines = [f"== {title}: {rows} rows, {a.num_launches} launches, {sum(a.syncs.values())} "
             f"syncs, {sum(a.uploads.values())} uploads "
             f"({sum(a.upload_bytes.values())} bytes), {a.num_allocs} allocations "
             f"({a.alloc_bytes} bytes)", "  launches by part of the step:"]
    for kind, n in a.launches_by_kind().items():
        k = per_layer.get(kind, 0)
        lines.append(f"    {kind:24s} {n:5d}" + (f"  ({n / k:.0f} per layer)" if k else ""))
    top = collections.Counter({name: n for (_, name), n in a.launches.items()})
    lines.append("  most launched: " + ", ".join(f"{nm} x{n}" for nm, n in top.most_common(8)))
    for label, counter in (("syncs (device->host)", a.syncs), ("uploads (host->device)",
                                                                a.uploads)):
        lines.append(f"  {label}:")
        by_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (what, site), n in counter.items():
            by_site[site][what] += n
        for site, whats in sorted(by_site.items()):
            lines.append(f"    {site}: " + "; ".join(f"{w} x{n}" for w, n in whats.items()))
    lines.append("  allocations by site (top 8): " + ", ".join(
        f"{site} x{n}" for site, n in a.allocs.most_common(8)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=ARCHS, action="append",
                    help="architecture (repeatable; default both)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rows", type=int, default=5, help="rows per slot of the verify step")
    ap.add_argument("--kernels", default="all,none",
                    help="comma list of TANDEM_GPU_KERNELS runs (default: all,none)")
    args = ap.parse_args(argv)
    for arch in args.arch or ARCHS:
        for kernels in args.kernels.split(","):
            steps = audit_steps(arch, args.slots, args.rows, kernels)
            layers = steps.pop("layers")
            for name, (a, rows) in steps.items():
                print(report(f"{arch} {name}, kernels {kernels}", a, rows, layers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
