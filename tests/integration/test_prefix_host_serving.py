"""The prefix cache's host tier through the real service (``[scheduler] prefix_cache_host_mb``):
the daemon tells the model worker process, over the worker link, to copy a checkpoint the
GPU's budget pushed out into host memory (OFFLOAD), and a conversation's next turn starts from
that copy. The model's Gated DeltaNet states are made large (~0.8 MB a checkpoint) so a 1 MB
GPU tier holds one conversation's checkpoint: a second conversation pushes the first one's
out."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from scripts.bench_common import parse_samples
from scripts.tiny_model import make_tiny_model
from tests.integration.server import Server

MODEL_NAME = "tandem-test"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "qwen3_next", seed=7, layers=4,
                           linear_value_heads=8, linear_key_dim=64, linear_value_dim=64)


def _turns(url: str) -> int:
    """Two conversations' first turns, then the first one's next turn: its cached tokens."""
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}

    def first(n: int) -> list[dict]:
        return [{"role": "system", "content": f"Agent {n} reviews code. " * 6},
                {"role": "user", "content": "Read utils.py and say what it does."}]

    async def go() -> dict:
        async with aiohttp.ClientSession() as s:
            answers = []
            for n in range(2):
                body = {"model": MODEL_NAME, "messages": first(n), "max_tokens": 8,
                        "temperature": 0, **thinking}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    answers.append((await r.json())["choices"][0]["message"]["content"])
            follow = first(0) + [{"role": "assistant", "content": answers[0]},
                                 {"role": "user", "content": "Now write its tests."}]
            body = {"model": MODEL_NAME, "messages": follow, "max_tokens": 8, "temperature": 0,
                    **thinking}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]

    return asyncio.run(go())["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("host_mb", [0, 64])
def test_a_conversation_pushed_off_the_gpu_resumes_from_host_memory(model, tmp_path, host_mb):
    srv = Server(tmp_path, model, scheduler={"prefix_cache_max_mb": 1,
                                             "prefix_cache_host_mb": host_mb}).start()
    try:
        cached = _turns(srv.url)
        samples = parse_samples(srv.get("/metrics")[1])
    finally:
        assert srv.stop() == 0

    def metric(name: str, tier: str) -> float:
        return samples.get((name, (("tier", tier),)), 0.0)

    host_hits = metric("tandem_prefix_cache_hits_total", "host")
    if host_mb:  # the next turn started from its history, copied back from host memory
        assert cached > 32 and host_hits == 1
        assert metric("tandem_prefix_cache_entries", "host") >= 1
        assert 0 < metric("tandem_prefix_cache_bytes", "host") <= host_mb * 2**20
    else:  # the GPU tier alone lost it to the second conversation
        assert cached == 0 and host_hits == 0
        assert metric("tandem_prefix_cache_entries", "host") == 0
    assert metric("tandem_prefix_cache_bytes", "gpu") <= 2**20
