"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on tiny Qwen3-MoE / Qwen3-Next checkpoints
(scripts/tiny_model.py) and check that Tandem loads what it writes (docs/gguf.md, "Checked
against llama.cpp's converter").

    python -m scripts.check_llamacpp_gguf --converter /tmp/llama.cpp/convert_hf_to_gguf.py
    python -m scripts.check_llamacpp_gguf --converter ... --fixtures tests/fixtures/gguf_llamacpp

The converter is not part of Tandem and is never downloaded here: point ``--converter`` (or
``TANDEM_LLAMACPP_CONVERTER`` for tests/unit/test_gguf_llamacpp.py) at a llama.cpp checkout's
file, or at the one inside a llama-cpp-python sdist (``vendor/llama.cpp/``). It runs
unchanged in a subprocess of this Python (it needs torch, transformers and its own
``gguf-py``, which it puts on sys.path itself), with one override: the converter names a BPE
pre-tokenizer by the hash of how the tokenizer encodes a fixed text, which only the real
Qwen vocabulary matches, so the tiny tokenizer (Qwen2's split pattern, a small vocabulary)
is declared ``qwen2``, the name the converter writes for real Qwen3 checkpoints. Tensors and
every other metadata key are the converter's own.

With ``--fixtures DIR`` the F32 and Q8_0 files of the small FIXTURE_SIZES models are written
there (the test fixtures); the command prints each file's size and its logits' largest
difference from the safetensors model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ENV = "TANDEM_LLAMACPP_CONVERTER"
ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
OUTTYPES = ("f32", "f16", "q8_0")
SEED = 7
# the committed fixtures: every matrix row a whole number of Q8_0 blocks (32), small files
FIXTURE_SIZES = {"hidden": 32, "heads": 2, "kv_heads": 1, "head_dim": 16, "experts": 4,
                 "moe_intermediate": 32, "intermediate": 32, "shared_intermediate": 32,
                 "vocab": 320}
IDS = [5, 17, 300, 42, 7, 99, 250, 3, 128, 64]

# Runs in the subprocess: load the converter as a module, override only the pre-tokenizer
# detection (see the module docstring), then its main() with the remaining arguments. The
# converter's classes live in the file itself (older) or in conversion/base.py (newer).
_DRIVER = """
import importlib, importlib.util, sys
from pathlib import Path
path = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(path.parent))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", path)
mod = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = mod
spec.loader.exec_module(mod)
text_model = getattr(mod, "TextModel", None) or importlib.import_module("conversion.base").TextModel
text_model.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [str(path), *sys.argv[2:]]
mod.main()
"""


def converter_problem(converter: str | os.PathLike | None) -> str | None:
    """Why ``converter`` cannot be run here (None: it can): unset, missing, torch or
    transformers not installed, or a converter without both architectures."""
    if not converter:
        return (f"{ENV} is not set (point it at llama.cpp's convert_hf_to_gguf.py; "
                "docs/gguf.md says how)")
    path = Path(converter)
    if not path.is_file():
        return f"{ENV}={converter}: no such file"
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"the converter needs {module}, not installed in {sys.executable}"
    sources = [path, *sorted((path.parent / "conversion").glob("*.py"))]
    text = "".join(p.read_text(errors="replace") for p in sources)
    missing = [hf for hf in ARCHS.values() if hf not in text]
    if missing:
        return f"{path} does not convert {', '.join(missing)} (llama.cpp too old)"
    return None


def convert(converter: str | os.PathLike, model_dir: Path, out: Path, outtype: str) -> Path:
    """``model_dir`` converted by ``converter`` to GGUF ``out`` (``outtype``: the
    converter's --outtype: f32, f16, bf16, q8_0); RuntimeError with its output's tail."""
    cmd = [sys.executable, "-c", _DRIVER, str(converter), str(model_dir),
           "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{tail}")
    return out


def max_logit_diff(file: Path, model_dir: Path) -> float:
    """Largest |logit| difference over IDS between the GGUF and the safetensors model."""
    from gpu_worker.engine import Engine  # the heavy import only where it is used

    ours = Engine.from_dir(file, dtype="float32").score(IDS)
    theirs = Engine.from_dir(model_dir, dtype="float32").score(IDS)
    return float(np.abs(ours - theirs).max())


def main(argv: list[str] | None = None) -> int:
    from scripts.tiny_model import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--converter", default=os.environ.get(ENV),
                    help=f"llama.cpp's convert_hf_to_gguf.py (default: ${ENV})")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tandem-llamacpp"),
                    help="where the tiny checkpoints and outputs go")
    ap.add_argument("--fixtures", type=Path, default=None,
                    help="write the F32 / Q8_0 fixtures of the small models here")
    args = ap.parse_args(argv)
    problem = converter_problem(args.converter)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    small = args.fixtures is not None
    out_dir = args.fixtures if small else args.work
    out_dir.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        sizes = FIXTURE_SIZES if small else {}
        model = make_tiny_model(args.work / f"{arch}{'-small' if small else ''}", arch,
                                seed=SEED, **sizes)
        for outtype in ("f32", "q8_0") if small else OUTTYPES:
            file = convert(args.converter, model, out_dir / f"{arch}-{outtype}.gguf", outtype)
            print(f"{file}: {file.stat().st_size} bytes, largest logit difference "
                  f"{max_logit_diff(file, model):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
