"""scripts/train finetune-ul: candidates, loop cuts, the eval's stopping rule, targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scripts import compile_rule as rule

pytest.importorskip("torch")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tandem-tiny"
EOT, IM_END = 8166, 8168


# after the skips: these import torch and transformers
from scripts.train import compile_rate as cr  # noqa: E402
from scripts.train import unlikelihood as ul  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_repeated_ngram_mask_marks_every_token_of_a_repeat():
    assert ul.repeated_ngram_mask([1, 2, 3, 4, 5], 2) == [False] * 5
    # 1 2 3 | 1 2 3: the bigrams (1,2), (2,3) repeat; (3,1) does not
    assert ul.repeated_ngram_mask([1, 2, 3, 1, 2, 3], 2) == [False, False, False, True, True,
                                                             True]
    assert ul.repeated_ngram_mask([7, 7, 7], 2) == [False, True, True]
    assert ul.repeated_ngram_mask([1, 2], 4) == [False, False]


def test_first_repeated_line_ignores_blanks_and_other_indentation():
    body = "    x = 1\n\n\n        x = 1\n    y = 2\n    x = 1\n    x = 1\n"
    assert body[ul.first_repeated_line(body):].startswith("    x = 1\n    x = 1")
    assert ul.first_repeated_line("    a\n    b\n\n") is None


def test_greedy_stop_replays_the_eval_rule(tok):
    body = _ids(tok, "    return 1\n")
    dedent = _ids(tok, "    return 1\nclass A:\n    pass\n")
    out, stop = rule.greedy_stop(tok, dedent, 160, (IM_END, EOT))
    assert stop == "dedent"
    assert tok.decode(out).startswith("    return 1\nclass")
    assert not rule.body_ended(tok.decode(out[:-1]))  # the first prefix that ends the body
    out, stop = rule.greedy_stop(tok, body + [EOT, 5, 6], 160, (IM_END, EOT))
    assert (out, stop) == (body, "eos")
    loop = _ids(tok, "    f()\n" * 30)
    out, stop = rule.greedy_stop(tok, loop[:20], 20, (IM_END, EOT))
    assert (out, stop) == (loop[:20], "limit")


def test_body_target_cuts_the_loop_and_ends_with_eot(tok):
    prompt = 'def f(x):\n    """Doc."""\n'
    gen = _ids(tok, "    if x:\n        g()\n    h()\n    h()\n    h()\n    h(")
    target = ul.body_target(tok, prompt, gen, "limit", EOT)
    assert target[-1] == EOT
    assert tok.decode(target[:-1]) == "    if x:\n        g()\n    h()\n"
    assert target[:-1] == gen[: len(target) - 1]  # the completion's own tokens
    # a cut that leaves an open block does not compile: no target
    bad = _ids(tok, "    if x:\n    if x:\n    if x:\n")
    assert ul.body_target(tok, prompt, bad, "limit", EOT) is None


def test_function_prompts_split_func_documents(tok):
    docs = ['def f(a):\n    """Add one.\n    """\n    return a + 1\n',
            'def g():\n    """Nothing here."""\n    pass\n']  # no closing line of its own
    stream = np.asarray(sum((_ids(tok, d) + [EOT] for d in docs), []), dtype=np.uint16)
    prompts = ul.function_prompts(tok, stream, EOT, 320)
    assert [p["prompt"] for p in prompts] == ['def f(a):\n    """Add one.\n    """\n']
    assert prompts[0]["ids"] == _ids(tok, prompts[0]["prompt"])


def test_validation_functions_exclude_the_headline(tmp_path):
    rows = [{"module": "m", "name": n, "prompt": "", "source": ""} for n in "abcd"]
    funcs, head = tmp_path / "all.jsonl", tmp_path / "head.jsonl"
    funcs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    head.write_text(json.dumps(rows[1]) + "\n" + json.dumps(rows[3]) + "\n")
    assert [f["name"] for f in cr.validation_functions(funcs, head)] == ["a", "c"]
