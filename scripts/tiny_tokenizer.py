"""A small Qwen-style byte-level BPE tokenizer and chat template for tiny test models.

Trained with `tokenizers` on a fixed text: a few Python standard-library sources read from
disk plus a short built-in multilingual passage, so the result is deterministic on one
Python installation. Pre-tokenization, decoder and special tokens follow Qwen2/Qwen3's
`tokenizer.json` layout; the special tokens come after the learned vocabulary, as in Qwen.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2/Qwen3 pre-tokenizer split pattern.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # added, not special
_CORPUS_FILES = ("textwrap.py", "string.py", "json/encoder.py", "json/decoder.py", "heapq.py",
                 "bisect.py", "calendar.py")
_BUILTIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a
few experts. Hello, world! How are you today? I am fine, thank you.
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
你好，世界！今天天气很好。我们一起学习机器学习和自然语言处理。
こんにちは、世界。東京は日本の首都です。
Привет, мир! Как дела? Γειά σου κόσμε. مرحبا بالعالم. שלום עולם.
Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 — naïve café, Straße, façade, résumé, ½ ≤ ∑ ∞.
"""

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def training_text() -> str:
    """The fixed training text: selected stdlib sources (those present) + a built-in passage."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [_BUILTIN_TEXT]
    for name in _CORPUS_FILES:
        try:
            parts.append((stdlib / name).read_text(encoding="utf-8"))
        except OSError:
            continue
    return "\n".join(parts)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids (learned + special + added tokens)."""
    reserved = len(SPECIAL_TOKENS) + len(EXTRA_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + reserved + 1:
        raise ValueError(f"vocab must be at least {len(alphabet) + reserved + 1} for a "
                         f"byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - reserved, min_frequency=2,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(training_text().splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() < vocab_size - reserved:  # the text ran out of merges
        tok = _extend_merges(tok, vocab_size - reserved)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(EXTRA_TOKENS))
    if tok.get_vocab_size() != vocab_size:  # cannot happen with the sizes above; keep it loud
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, model vocab {vocab_size}")
    return tok


def _extend_merges(tok: Tokenizer, size: int) -> Tokenizer:
    """A BPE of exactly ``size`` ids: the trained one plus merges of a word-start token
    ('Ġ' or a letter first) with a lowercase-ASCII continuation, lowest priority, pairs in
    order of the sum of their ids. The training text has only ~3.4k ids' worth of merges;
    a model's vocabulary (e.g. 151936) needs every id to decode to text."""
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    by_id = sorted(vocab, key=vocab.get)
    starts = [t for t in by_id if t[:1] == "Ġ" and t[1:].isascii() and t[1:].isalpha()
              or t.isascii() and t.isalpha()]
    tails = [t for t in by_id if t.isascii() and t.isalpha() and t.islower()]
    as_str = bool(merges) and isinstance(merges[0], str)
    need = size - len(vocab)
    for total in range(len(starts) + len(tails) - 1):
        for i in range(max(0, total - len(tails) + 1), min(total, len(starts) - 1) + 1):
            a, b = starts[i], tails[total - i]
            if a + b in vocab:
                continue
            vocab[a + b] = len(vocab)
            merges.append(f"{a} {b}" if as_str else [a, b])
            need -= 1
            if not need:
                return Tokenizer.from_str(json.dumps(data))
    raise ValueError(f"cannot build a tokenizer of {size} ids from {len(starts)} x "
                     f"{len(tails)} token pairs")


def write_tokenizer(out_dir: Path, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return special ids."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *EXTRA_TOKENS)}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in (*SPECIAL_TOKENS, *EXTRA_TOKENS)}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids
