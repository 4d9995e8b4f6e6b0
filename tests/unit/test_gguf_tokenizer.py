"""The daemon's tokenizer of a GGUF file (daemon/gguf_tokenizer.py) against the model
directory's tokenizer.json it was converted from."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.tokenizer import MissingTokenizerError, Tokenizer
from scripts.tiny_model import make_tiny_model
from tests.unit.gguf_tiny import write_gguf

TEXTS = ["def reverse(s):\n    return s[::-1]\n", "Hello, world! How are you today?",
         "你好，世界！ naïve café 😀 🇫🇷  ½ ≤ ∞", "<|im_start|>user\nhi<|im_end|>\n<think>",
         "  leading spaces\t\ttabs\r\n\n", "it's they'll I'M 12345"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    root = tmp_path_factory.mktemp("gguf_tok")
    model = make_tiny_model(root / "m", "qwen3_moe", mtp=False)
    return Tokenizer.from_dir(write_gguf(model, root / "m.gguf")), Tokenizer.from_dir(model)


def test_encodes_and_decodes_like_tokenizer_json(pair) -> None:
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode_plain(text) == theirs.encode_plain(text)
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.special_tokens == theirs.special_tokens
    assert ours.token_to_id("<think>") == theirs.token_to_id("<think>") is not None


def test_chat_template_and_eos(pair) -> None:
    ours, theirs = pair
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is <|im_end|> here?"}]
    assert ours.chat_template == theirs.chat_template
    assert ours.encode_chat(messages) == theirs.encode_chat(messages)
    assert sorted(ours.eos_token_ids) == sorted(theirs.eos_token_ids)
    assert ours.template_tokens["eos_token"] == "<|im_end|>"


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "qwen3_moe", tokenizer=False, mtp=False)
    with pytest.raises(MissingTokenizerError, match="no tokenizer in this GGUF"):
        Tokenizer.from_dir(write_gguf(model, tmp_path / "m.gguf"))
