"""The tokenizer and chat template of a GGUF file, from its metadata.

llama.cpp's converter stores a Qwen tokenizer (byte-level BPE) as ``tokenizer.ggml.model =
"gpt2"``, ``tokenizer.ggml.pre = "qwen2"``, ``tokenizer.ggml.tokens`` (every id's text, in
the byte-to-unicode form of tokenizer.json), ``tokenizer.ggml.token_type`` (1 normal, 3
control, 4 user-defined, 5 unused, ...), ``tokenizer.ggml.merges`` ("a b" strings), the
special ids ``tokenizer.ggml.{eos,eot,eom,bos,padding}_token_id`` and
``tokenizer.chat_template``. This rebuilds the equivalent `tokenizers` BPE (Qwen2's
pre-tokenizer split, NFC, byte-level decoding; control tokens special, user-defined tokens
added but not special), so the daemon tokenizes a GGUF model itself, without the worker.
Only the first file of a split set is read (it holds the metadata).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from gguf import GGUFReader

# Qwen2/Qwen3's pre-tokenizer split (tokenizer.json's Split pattern)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": QWEN2_SPLIT}
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5
END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # as gpu_worker/weights/gguf_source.py


class GGUFTokenizerError(ValueError):
    """A GGUF whose tokenizer metadata is missing or of a kind not rebuilt here."""


def read_gguf_tokenizer(path: str | Path) -> dict[str, Any]:
    """``{"backend", "chat_template", "eos_token_ids", "template_tokens"}`` of GGUF
    ``path`` (daemon/tokenizer.py's Tokenizer takes them)."""
    try:
        reader = GGUFReader(Path(path), "r")
    except (OSError, ValueError) as exc:
        raise GGUFTokenizerError(f"{path}: not a readable GGUF file: {exc}") from None

    def meta(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    kind, pre = meta("tokenizer.ggml.model"), meta("tokenizer.ggml.pre")
    if kind is None:
        raise GGUFTokenizerError(f"{path}: no tokenizer in this GGUF (tokenizer.ggml.model)")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"{path}: unsupported tokenizer tokenizer.ggml.model="
                                 f"{kind!r}, tokenizer.ggml.pre={pre!r} (Tandem rebuilds "
                                 f"gpt2 with {', '.join(PRE_TOKENIZERS)})")
    tokens: list[str] = meta("tokenizer.ggml.tokens") or []
    types = [int(t) for t in (meta("tokenizer.ggml.token_type") or [1] * len(tokens))]
    merges = meta("tokenizer.ggml.merges") or []
    backend = tokenizers.Tokenizer.from_str(json.dumps(_tokenizer_json(
        tokens, types, merges, PRE_TOKENIZERS[pre])))
    ids = {k: meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom", "bos",
                                                             "padding")}
    eos = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    eos += [i for i, t in enumerate(tokens) if t in END_TOKENS]
    names = {"eos_token": ids["eos"], "bos_token": ids["bos"], "pad_token": ids["padding"]}
    return {"backend": backend, "chat_template": meta("tokenizer.chat_template"),
            "eos_token_ids": list(dict.fromkeys(int(i) for i in eos)),
            "template_tokens": {k: tokens[int(i)] for k, i in names.items()
                                if i is not None and 0 <= int(i) < len(tokens)}}


def _tokenizer_json(tokens: list[str], types: list[int], merges: list[str],
                    split: str) -> dict[str, Any]:
    """A tokenizer.json (byte-level BPE, Qwen's layout) of the GGUF vocabulary."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
             if kind in (CONTROL, USER_DEFINED)]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
             if kind not in (CONTROL, USER_DEFINED, UNUSED)}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": list(merges)},
    }
