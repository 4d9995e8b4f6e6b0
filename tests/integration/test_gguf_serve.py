"""``tandem serve --model FILE.gguf``: a tiny qwen3moe written as GGUF (F32) serves the same
greedy completion as its safetensors model, and chat through the GGUF's own tokenizer and
chat template."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from daemon.tokenizer import Tokenizer
from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.integration.server import Server
from tests.unit.gguf_tiny import write_gguf

PROMPT = [5, 17, 300, 42, 7, 99]


def _post(srv: Server, path: str, body: dict) -> dict:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_a_gguf_file(tmp_path) -> None:
    model = make_tiny_model(tmp_path / "m", "qwen3_moe", seed=11, mtp=False)
    file = write_gguf(model, tmp_path / "tiny.gguf")
    engine = Engine.from_dir(model, dtype="float64", max_slots=1, max_len=64)
    want = engine.generate(PROMPT, params=SamplingParams(temperature=0.0), max_tokens=8,
                           eos_ids=tuple(Tokenizer.from_dir(model).eos_token_ids))
    for weights in model.glob("*.safetensors"):  # only the GGUF holds the weights now
        weights.unlink()
    srv = Server(tmp_path, model)  # [model] path, overridden by --model below
    srv.proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "serve", "--config", str(srv.config),
         "--model", str(file)], stdout=srv.log.open("w"), stderr=subprocess.STDOUT)
    try:
        srv.wait_ready(120)
        done = _post(srv, "/v1/completions", {"model": "tandem-test", "prompt": PROMPT,
                                              "max_tokens": 8, "temperature": 0})
        text = Tokenizer.from_dir(file).decode(want)
        assert done["choices"][0]["text"] == text
        assert done["usage"]["completion_tokens"] == len(want)
        chat = _post(srv, "/v1/chat/completions", {
            "model": "tandem-test", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello, how are you?"}]})
        choice = chat["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert chat["usage"]["prompt_tokens"] == len(Tokenizer.from_dir(model).encode_chat(
            [{"role": "user", "content": "Hello, how are you?"}]))
        assert isinstance(choice["message"]["content"], str)
    finally:
        assert srv.stop() == 0
