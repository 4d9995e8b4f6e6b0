"""The tandem-tiny corpus builder, its chat rendering, and the shipped model directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from scripts import build_corpus, corpus_chat, corpus_functions, corpus_sources

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tandem-tiny"



def _jinja_render(messages: list[dict], tools: list[dict] | None = None, **kw) -> str:
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **k: json.dumps(x, ensure_ascii=False)
    assert jinja2
    tmpl = env.from_string((MODEL_DIR / "chat_template.jinja").read_text())
    return tmpl.render(messages=messages, tools=tools, **kw)


CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string"},
     {"role": "assistant", "content": "```python\ndef rev(s):\n    return s[::-1]\n```"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "héllo"}],
]

TOOL_CHAT = [
    {"role": "user", "content": "What does `f` in `Lib/x.py` do?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "Lib/x.py"}}]},
    {"role": "tool", "content": "def f():\n    pass\n"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"name": "check_python", "arguments": {"path": "Lib/x.py"}},
                    {"name": "read_file", "arguments": {"path": "Lib/y.py"}}]},
    {"role": "tool", "content": "OK"},
    {"role": "tool", "content": "pass"},
    {"role": "assistant", "content": "`f` does nothing."},
]


@pytest.mark.parametrize("messages", CHATS)
def test_render_chat_matches_template(messages: list[dict]) -> None:
    assert corpus_chat.render_chat(messages) == _jinja_render(messages)


def test_render_tool_chat_matches_template() -> None:
    got = corpus_chat.render_chat(TOOL_CHAT, corpus_chat.TOOLS)
    assert got == _jinja_render(TOOL_CHAT, corpus_chat.TOOLS)
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "Lib/x.py"}}\n</tool_call>' \
        in got
    assert "<|im_start|>user\n<tool_response>\nOK\n</tool_response>\n<tool_response>" in got
    assert got.endswith("<think>\n\n</think>\n\n`f` does nothing.<|im_end|>\n")


def test_generation_prompt_is_qwen3() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert _jinja_render(msgs, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_split_key_groups_tests_with_their_module() -> None:
    assert corpus_sources.split_key("json.decoder") == "json"
    assert corpus_sources.split_key("test.test_json.test_fail") == "json"
    assert corpus_sources.split_key("_pydecimal") == "pydecimal"
    assert corpus_sources.is_heldout("distutils") == corpus_sources.is_heldout("distutils")


def test_third_person() -> None:
    assert corpus_chat.third_person("Return the sum.") == "returns the sum"
    assert corpus_chat.third_person("Copy data") == "copies data"
    assert corpus_chat.third_person("Push it") == "pushes it"
    assert corpus_chat.third_person("The thing.") is None


def test_extract_functions_strips_docstring() -> None:
    src = 'def f(a,\n      b):\n    """Add a and b."""\n    total = a + b\n    return total\n'
    mod_doc, funcs, classes = corpus_functions.extract_functions(src)
    assert mod_doc is None and not classes
    assert len(funcs) == 1
    assert funcs[0].signature == "def f(a,\n      b):"
    assert '"""' not in funcs[0].body_without_doc
    assert "total = a + b" in funcs[0].body_without_doc


def _fake_stdlib(root: Path) -> None:
    body = ('"""' + 'Module doc that is long enough to be prose. ' * 6 + '"""\n\n'
            'def reverse(s):\n    """Return s reversed."""\n    out = s[::-1]\n    return out\n')
    for key in ("alpha", "beta", "gamma", "delta", "eps", "zeta"):
        (root / f"{key}.py").write_text(body.replace("reverse", f"rev_{key}"))
    (root / "dup1.py").write_text("x = 1\n")
    (root / "dup2.py").write_text("x  =  1\n")  # same after whitespace normalisation
    (root / "site-packages").mkdir()
    (root / "site-packages" / "skip.py").write_text("y = 2\n")


def test_build_is_deterministic_and_deduplicated(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    _fake_stdlib(lib)
    m1 = build_corpus.build(tmp_path / "a", lib)
    m2 = build_corpus.build(tmp_path / "b", lib)
    assert m1["sha256"] == m2["sha256"]
    docs = [json.loads(line) for s in ("train", "heldout")
            for line in (tmp_path / "a" / f"{s}.jsonl").read_text().splitlines()]
    texts = [d["text"] for d in docs]
    assert sum(t.strip() in ("x = 1", "x  =  1") for t in texts) == 1
    assert not any("y = 2" in t for t in texts)
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"code", "prose", "chat"}
    for d in docs:  # every document lands in the split its key says
        split = "heldout" if corpus_sources.is_heldout(d["key"]) else "train"
        assert d in [json.loads(x) for x in
                     (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines()]


def _fake_wheel(lib: Path, files: dict[str, str]) -> None:
    import zipfile

    bundled = lib / "ensurepip" / "_bundled"
    bundled.mkdir(parents=True)
    with zipfile.ZipFile(bundled / "fake-1.0-py3-none-any.whl", "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)


def test_wheels_and_function_documents_go_to_train_only(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    _fake_stdlib(lib)
    assert corpus_sources.is_heldout("logging") and not corpus_sources.is_heldout("alpha")
    heldout_src = "".join(f"def handler_{i}(record):\n    return format_record_with_level(record, "
                          f"level={i})\n\n" for i in range(20))
    (lib / "logging.py").write_text(heldout_src)
    fresh = ('def vendored(s):\n    """Return s twice, vendored."""\n'
             '    doubled_value_for_the_test = s + s\n    return doubled_value_for_the_test\n')
    _fake_wheel(lib, {"fake/__init__.py": fresh,
                      "fake/_vendor/logcopy.py": heldout_src,  # copies held-out code: skipped
                      "fake/table.py": "T = [" + "0x1f, 0x2e, 0x3d, " * 200 + "]\n"})
    m0 = build_corpus.build(tmp_path / "stdlib_only", lib, wheels=False, functions=False)
    m1 = build_corpus.build(tmp_path / "full", lib)
    # the held-out split and the held-out functions do not change; the train split only grows
    for name in ("heldout.jsonl", "heldout_functions.jsonl"):
        assert m0["sha256"][name] == m1["sha256"][name]
    before = (tmp_path / "stdlib_only" / "train.jsonl").read_bytes()
    assert (tmp_path / "full" / "train.jsonl").read_bytes().startswith(before)
    assert m1["wheel_files_skipped"] == {"data": 1, "heldout_overlap": 1}
    docs = [json.loads(x) for x in (tmp_path / "full" / "train.jsonl").read_text().splitlines()]
    wheel = [d for d in docs if d["key"].startswith(corpus_sources.WHEEL_KEY_PREFIX)]
    assert {d["key"] for d in wheel} == {"wheel:fake:fake"}
    assert any(d["kind"] == "code" and d["text"] == fresh for d in wheel)
    # a function document is the compile-rate prompt followed by the body
    funcs = [d["text"] for d in docs if d["kind"] == "func"]
    doc_block = '"""Return s twice, vendored.\n    """'
    assert fresh.replace('"""Return s twice, vendored."""', doc_block) in funcs
    held = [json.loads(x) for x in (tmp_path / "full" / "heldout.jsonl").read_text().splitlines()]
    assert held and not any(d["kind"] == "func" or "vendored" in d["text"] for d in held)


# --------------------------------------------------------------------------- shipped model


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def test_model_dir_files_and_format() -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja", "README.md",
                 "reference_logits.npz"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 24 * 1000 * 1000
    assert (MODEL_DIR / "reference_logits.npz").stat().st_size < 1024 * 1024
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is True
    hdr = _safetensors_header(MODEL_DIR / "model.safetensors")
    keys = {k for k in hdr if k != "__metadata__"}
    assert "lm_head.weight" not in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    e, inter, h = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    for prefix in [f"model.layers.{i}." for i in range(cfg["num_hidden_layers"])] + [
            "mtp.layers.0."]:
        for j in range(e):
            assert hdr[f"{prefix}mlp.experts.{j}.gate_proj.weight"]["shape"] == [inter, h]
            assert hdr[f"{prefix}mlp.experts.{j}.down_proj.weight"]["shape"] == [h, inter]
        assert hdr[f"{prefix}mlp.gate.weight"]["shape"] == [e, h]
    assert hdr["mtp.fc.weight"]["shape"] == [h, 2 * h]
    for k in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"):
        assert k in keys
    assert {v["dtype"] for k, v in hdr.items() if k != "__metadata__"} == {"BF16"}


def test_tokenizer_and_generation_config_agree() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    for special in ("<|im_start|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tok.encode(special, add_special_tokens=False).ids) == 1
    text = "def reverse(s):\n    return s[::-1]\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_heldout_function_selection() -> None:
    lines = (MODEL_DIR / "eval" / "heldout_functions_100.jsonl").read_text().splitlines()
    funcs = [json.loads(x) for x in lines]
    assert len(funcs) == 100
    for f in funcs:
        assert corpus_sources.is_heldout(corpus_sources.split_key(f["module"]))
        compile(f["prompt"], f["name"], "exec")  # signature + docstring alone is valid
        assert f["source"].lstrip().startswith(("def ", "async def ", "@"))


def test_reference_logits_layout() -> None:
    z = np.load(MODEL_DIR / "reference_logits.npz")
    ids, pos = z["input_ids"], z["positions"]
    assert ids.shape == (2, 48) and pos.max() <= ids.shape[1] - 2
    assert z["logits"].shape == z["mtp_logits"].shape == (2, len(pos), 8192)
    assert z["top32_idx"].shape == (2, 48, 32) and z["mtp_top32_idx"].shape == (2, 47, 32)
    # top-32 rows agree with the full rows where both exist
    np.testing.assert_array_equal(z["logits"].argmax(-1), z["top32_idx"][:, pos, 0])
    np.testing.assert_array_equal(z["mtp_logits"].argmax(-1), z["mtp_top32_idx"][:, pos, 0])
