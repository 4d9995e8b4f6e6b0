"""Tokenizer: round trips, streaming detokenizer, Qwen3 chat template, EOS ids, errors."""

from __future__ import annotations

import json
import shutil

import pytest

from daemon.tokenizer import (
    IncrementalDetokenizer,
    MissingTokenizerError,
    Tokenizer,
    TokenizerError,
)
from scripts.tiny_model import make_tiny_model

TEXTS = [
    "Hello, world! def f(x):\n    return x + 1\n",
    "你好，世界！今天天气很好。",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷, naïve café — Straße ½ ∞ 🦜",
    "mixed 日本語 text with <|im_end|> special and <think>tags</think>",
    "",
]
MULTIBYTE = "a😀b你好👍🏽 🇫🇷€\n🦜"  # 4-byte, 3-byte, ZWJ-free modifiers, a rare emoji


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tok"), "qwen3_moe", hidden=16, heads=2,
                           kv_heads=1, head_dim=8, experts=2, topk=1, moe_intermediate=8,
                           intermediate=16, layers=1, vocab=400)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def test_round_trip_and_no_added_specials(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode("") == []
    im_end = tok.special_tokens["<|im_end|>"]
    ids = tok.encode("x<|im_end|>")
    assert ids[-1] == im_end and ids.count(im_end) == 1  # special token text -> one id
    assert tok.decode(ids, skip_special_tokens=True) == "x"


def test_special_tokens_and_eos(tok):
    assert set(tok.special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert tok.eos_token_ids == [tok.special_tokens["<|im_end|>"],
                                 tok.special_tokens["<|endoftext|>"]]
    assert tok.vocab_size == 400
    assert tok.token_to_id("<think>") is not None and "<think>" not in tok.special_tokens


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_detokenizer_every_split_point(tok, use_decode_stream):
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE)  # multi-byte characters really span several tokens
    full = tok.decode(ids)
    for k in range(len(ids) + 1):
        det = IncrementalDetokenizer(tok, use_decode_stream=use_decode_stream)
        pieces = [det.add(ids[:k])] + [det.add(i) for i in ids[k:]]
        for piece in pieces:
            assert "\ufffd" not in piece  # never a broken character
        pieces.append(det.flush())
        assert "".join(pieces) == full == MULTIBYTE, k
        assert det.text == full


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_detokenizer_streams_early_and_flushes_partial(tok, use_decode_stream):
    det = IncrementalDetokenizer(tok, use_decode_stream=use_decode_stream)
    ids = tok.encode("hi 😀")
    emoji_bytes = len(ids) - tok.encode("hi ").__len__()
    assert emoji_bytes > 1
    out = [det.add(i) for i in ids[:-1]]
    assert "".join(out) == "hi "  # text before the emoji is out before it completes
    assert det.flush() == "\ufffd"  # the stream ended inside the emoji: decode says so too
    assert tok.decode(ids[:-1]) == "hi \ufffd"


def test_detokenizer_skip_special(tok):
    ids = tok.encode("<|im_start|>assistant\nok 你好<|im_end|>")
    det = tok.detokenizer(skip_special_tokens=True)
    text = "".join(det.add(i) for i in ids) + det.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) == "assistant\nok 你好"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "再见 👋"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather",
                                           "arguments": {"city": "Paris", "unit": "°C"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle — 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_chat_template_qwen3_format(tok):
    prompt = tok.apply_chat_template([{"role": "system", "content": "S"},
                                      {"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                     add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nHi<|im_end|>\n"
    no_think = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                       enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    think = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert think.endswith("<|im_start|>assistant\n")
    with_tools = tok.apply_chat_template(CONVERSATIONS[2], tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in with_tools  # tojson keeps non-ASCII
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
            '\n</tool_call><|im_end|>') in with_tools
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
            "<tool_response>\nsunny\n</tool_response><|im_end|>\n") in with_tools
    ids = tok.encode(prompt)
    assert ids[0] == tok.special_tokens["<|im_start|>"]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"enable_thinking": False},
                                    {"add_generation_prompt": False}])
def test_chat_template_matches_transformers(model_dir, tok, conv, kwargs):
    transformers = pytest.importorskip("transformers")
    hf = _hf_tokenizer(transformers, model_dir)
    messages = CONVERSATIONS[conv]
    hf_kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf.apply_chat_template(messages, tokenize=False, **hf_kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == expected
    assert tok.encode(expected) == hf.encode(expected, add_special_tokens=False)


_HF_CACHE: dict = {}


def _hf_tokenizer(transformers, model_dir):
    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = transformers.AutoTokenizer.from_pretrained(model_dir)
    return _HF_CACHE[model_dir]


def test_template_from_tokenizer_config(model_dir, tmp_path, tok):
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    other = Tokenizer.from_dir(path)
    assert other.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])
    # no template anywhere: tokenizing still works, chat does not
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = Tokenizer.from_dir(path)
    assert bare.encode("hi") == tok.encode("hi")
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_fallback_to_tokenizer_config(model_dir, tmp_path, tok):
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == [tok.special_tokens["<|im_end|>"]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_dir(path).eos_token_ids == [7]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, "x"]}))
    with pytest.raises(TokenizerError, match="generation_config.json.*eos_token_id"):
        Tokenizer.from_dir(path)


def write_template(model_dir, tmp_path, template: str):
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(template)
    return path


def test_template_errors(model_dir, tmp_path):
    path = write_template(model_dir, tmp_path, "{% if %}")
    with pytest.raises(TokenizerError, match="chat_template.jinja.*syntax error"):
        Tokenizer.from_dir(path)
    (path / "chat_template.jinja").write_text(
        "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
    (path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="unsafe"):  # the sandbox refuses
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content }}\n{% endfor %}")
    rendered = Tokenizer.from_dir(path).apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert rendered == "a\n"  # loopcontrols + trim_blocks
    (path / "chat_template.jinja").write_text("{{ eos_token }}|{{ pad_token }}|{{ extra }}")
    rendered = Tokenizer.from_dir(path).apply_chat_template([{"role": "user"}], extra=5)
    assert rendered == "<|im_end|>|<|endoftext|>|5"  # tokenizer_config's special tokens
    with pytest.raises(TokenizerError, match="role"):
        Tokenizer.from_dir(path).apply_chat_template([{"content": "no role"}])


def test_missing_and_bad_files(model_dir, tmp_path):
    with pytest.raises(MissingTokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(MissingTokenizerError) as info:
        Tokenizer.from_dir(path)
    assert isinstance(info.value, TokenizerError)
    assert str(path / "tokenizer.json") in str(info.value)
    (path / "tokenizer.json").write_text("{\"not\": \"a tokenizer\"}")
    with pytest.raises(TokenizerError, match="cannot load tokenizer") as info:
        Tokenizer.from_dir(path)
    assert not isinstance(info.value, MissingTokenizerError)
    shutil.copy(model_dir / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(path)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
def test_chat_history_len_is_what_the_next_turn_begins_with(tok, kwargs):
    """The messages without the generation prompt: a prefix of the prompt, and of the next
    turn's prompt (the answer and a new message appended), which the whole prompt is not
    when the generation prompt opens an empty thinking block."""
    messages = [{"role": "system", "content": "S <|im_end|> typed"},
                {"role": "user", "content": "Read f.py"}]
    ids = tok.encode_chat(messages, **kwargs)
    n = tok.chat_history_len(ids, messages, **kwargs)
    assert n is not None and 0 < n < len(ids)
    following = messages + [{"role": "assistant", "content": "Done."},
                            {"role": "user", "content": "Now run it"}]
    nxt = tok.encode_chat(following, **kwargs)
    assert nxt[:n] == ids[:n]
    if kwargs.get("enable_thinking") is False:
        assert nxt[:len(ids)] != ids  # the empty thinking block is not repeated
    assert tok.chat_history_len(ids[:n], messages, **kwargs) is None  # not shorter: none
