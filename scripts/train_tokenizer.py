#!/usr/bin/env python3
"""Train tandem-tiny's byte-level BPE tokenizer (Qwen2/Qwen3 style) with ``tokenizers``.

Reads ``train.jsonl`` from a corpus built by ``scripts/build_corpus.py`` and writes into
``--out`` (default ``models/tandem-tiny``): ``tokenizer.json``, ``tokenizer_config.json``.

The pre-tokenizer is Qwen2's (the same split regex, then byte-level without prefix space), the
normaliser NFC, the decoder byte-level; no BOS is added. The 26 Qwen3 added tokens take the last
ids, after the ``vocab - 26`` learned byte-level tokens, as in Qwen3 (``<|endoftext|>`` first).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in Qwen3's order; the special flag is Qwen3's.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]


def iter_texts(corpus: Path) -> Iterator[str]:
    with open(corpus / "train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)["text"]


def build_tokenizer(corpus: Path, vocab_size: int = 8192) -> Tokenizer:
    """Train the BPE on the corpus' train split and append the added tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(iter_texts(corpus), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    decoder = {}
    for content, special in ADDED_TOKENS:
        decoder[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t, s in ADDED_TOKENS[1:] if s][:2],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, required=True, help="dir from build_corpus.py")
    ap.add_argument("--out", type=Path, default=Path("models/tandem-tiny"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    tok = build_tokenizer(args.corpus, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    cfg = tokenizer_config(tok)
    (args.out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sample = "def reverse(s: str) -> str:\n    return s[::-1]\n"
    print("vocab", tok.get_vocab_size(), "sample tokens", len(tok.encode(sample).ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
