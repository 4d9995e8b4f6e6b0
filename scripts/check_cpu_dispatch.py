"""Compare the CPU-expert dispatch paths of a CuPy model token for token (a GPU diagnosis).

Builds a tiny random model, generates ``--tokens`` greedy tokens with every expert on one CPU
worker through the host path (NumPy copies), then through the launched path (the pinned
ring). Prints, per path, the wall time and the first token that differs from the host path
(None: identical), or the error raised.

    python -m scripts.check_cpu_dispatch --arch qwen3_moe --tokens 300
"""

from __future__ import annotations

import argparse
import time

from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.bench_common import PROMPT, tiny_checkpoint


def run(path: str, tokens: int, dispatch: str = "host") -> list[int] | None:
    engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1,
                             max_slots=1, max_len=tokens + 64)
    label = dispatch
    try:
        if dispatch == "host":
            engine.placement.use_host_path()
        t0 = time.perf_counter()
        out = engine.generate(PROMPT, params=SamplingParams(temperature=0), max_tokens=tokens)
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
    path = tiny_checkpoint(args.arch, moe_intermediate=64, std=0.1)
    ref = run(path, args.tokens, "host")
    for dispatch in ("launched",):
        got = run(path, args.tokens, dispatch)
        if got is not None and ref is not None:
            first = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b),
                         None)
            print(f"  first token differing from the host path: {first}", flush=True)


if __name__ == "__main__":
    main()
