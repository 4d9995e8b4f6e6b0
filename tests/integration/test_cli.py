"""`tandem generate` and `tandem score` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gpu_worker.engine import Engine
from scripts.tiny_model import make_tiny_model


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """A checkpoint without tokenizer files."""
    return make_tiny_model(tmp_path_factory.mktemp("bare"), "qwen3_next", seed=2,
                           tokenizer=False)


def gen(model, *extra):
    out = tandem("generate", "--model", str(model), "--prompt-ids", "5,6,7,8", "--json",
                 "--max-tokens", "12", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_seeded_sampling_is_reproducible(bare_model):
    a = gen(bare_model, "--temperature", "1.0", "--seed", "5")
    b = gen(bare_model, "--temperature", "1.0", "--seed", "5")
    c = gen(bare_model, "--temperature", "1.0", "--seed", "6")
    assert a == b and a["text"] is None
    assert a["token_ids"] != c["token_ids"]
    assert len(a["token_ids"]) <= 12


def test_model_without_tokenizer_needs_ids(bare_model):
    out = tandem("generate", "--model", str(bare_model), "--prompt", "hello")
    assert out.returncode == 2
    assert out.stderr.startswith("tandem: error:") and "--prompt-ids" in out.stderr
    assert "Traceback" not in out.stderr


def test_score_writes_every_position(bare_model, tmp_path):
    dest = tmp_path / "logits.npy"
    out = tandem("score", "--model", str(bare_model), "--prompt-ids", "1,2,3,4,5",
                 "--out", str(dest))
    assert out.returncode == 0, out.stderr
    logits = np.load(dest)
    assert logits.shape == (5, 512) and logits.dtype == np.float32
    ref = Engine.from_dir(bare_model, max_slots=1, max_len=8).score([1, 2, 3, 4, 5])
    assert np.array_equal(logits, ref)


@pytest.mark.parametrize("args,needle", [
    (("--model", "/nonexistent/model", "--prompt-ids", "1"), "does not exist"),
    (("--prompt-ids", "1,x"), "comma-separated"),
    (("--prompt-ids", "999999"), "token ids must be in"),
    (("--prompt-ids", "1", "--temperature", "-1"), "temperature"),
])
def test_bad_input_is_one_clear_line(bare_model, args, needle):
    if "--model" not in args:
        args = ("--model", str(bare_model), *args)
    out = tandem("generate", *args, "--json")
    assert out.returncode == 2, out
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_chat_generation_with_tokenizer(tmp_path):
    model = make_tiny_model(tmp_path, "qwen3_moe", seed=1)
    out = tandem("generate", "--model", str(model), "--chat", "--prompt", "hi",
                 "--max-tokens", "5", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")


def test_check_config_prints_the_plan_or_refuses_it(bare_model, tmp_path):
    """No weight is read: a model directory with only config.json plans the same."""
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((bare_model / "config.json").read_bytes())
    for model in (bare_model, only_config):
        file = tmp_path / "ok.toml"
        file.write_text(f'[model]\npath = "{model}"\n[experts]\nplacement = "split"\n'
                        "gpu_memory_gb = 64\n")
        out = tandem("check-config", str(file))
        assert out.returncode == 0, out.stderr
        assert "memory plan (before any weight is read):" in out.stdout
        assert "routed experts per layer: 8 of 8 on the GPU" in out.stdout
        assert "experts per layer chosen by the memory plan; GPU budget 64 GiB" in out.stdout
    file.write_text(f'[model]\npath = "{only_config}"\n[experts]\nplacement = "split"\n'
                    "gpu_memory_gb = 0.0001\n")
    out = tandem("check-config", str(file))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("tandem: memory plan refused: needs ")
    assert "MiB over the 0.1 MiB budget" in out.stderr and "GPU total:" in out.stdout


def test_check_config_refuses_a_cpu_placement_the_model_cannot_use(tmp_path):
    """The embedded model's experts (I = 48) cannot be cut into the CPU experts' blocks of 32:
    check-config says so in one line instead of passing a config `serve` then fails on."""
    file = tmp_path / "cpu.toml"
    file.write_text('[experts]\nplacement = "cpu"\n')
    out = tandem("check-config", str(file))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("tandem: memory plan refused: placement 'cpu'")
    assert "multiples of 32; this model has 256 and 48" in out.stderr
