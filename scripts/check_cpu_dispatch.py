"""Compare the CPU-expert dispatch paths of a CuPy model token for token (a GPU diagnosis).

Builds a tiny random model, generates ``--tokens`` greedy tokens with every expert on one CPU
worker through the host path (QFUSE standalone: NumPy copies), then through the pinned ring:
synchronous, launched with the partials copied by DMA, launched reading them from the mapped
ring with system-scope loads and with plain loads. Prints, per path, the wall time and the
first token that differs from the host path (None: identical), or the error raised.

    python3 scripts/check_cpu_dispatch.py --arch qwen3_moe --tokens 300
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import gpu_worker.cpu_link as cpu_link
from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model


def run(path: str, tokens: int, qfuse: str, dispatch: str = "sync",
        kernel_out: bool | None = None, system_loads: bool = True) -> list[int] | None:
    cpu_link.SYSTEM_LOADS = system_loads
    engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1, qfuse=qfuse,
                             max_slots=1, max_len=tokens + 64, cpu_dispatch=dispatch)
    label = f"{qfuse} {dispatch} kernel_out={kernel_out} system_loads={system_loads}"
    try:
        if kernel_out is not None and engine.placement.link is not None:
            engine.placement.link.kernel_out = kernel_out
        prompt = np.arange(3, 40) * 11 % 500
        t0 = time.perf_counter()
        out = engine.generate(prompt, params=SamplingParams(temperature=0), max_tokens=tokens)
        print(f"{label}: {time.perf_counter() - t0:.1f} s", flush=True)
        return out
    except Exception as exc:  # noqa: BLE001 -- a diagnosis: report and go on
        print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "qwen3_next"))
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    path = make_tiny_model(tempfile.mkdtemp(), args.arch, seed=9, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    ref = run(path, args.tokens, "standalone")
    for dispatch, kernel_out, system_loads in (("sync", False, True), ("launched", False, True),
                                               ("launched", True, True),
                                               ("launched", True, False)):
        got = run(path, args.tokens, "fused", dispatch, kernel_out, system_loads)
        if got is not None and ref is not None:
            first = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b),
                         None)
            print(f"  first token differing from the host path: {first}", flush=True)


if __name__ == "__main__":
    main()
