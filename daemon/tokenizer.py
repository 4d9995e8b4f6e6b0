"""Tokenizer, streaming detokenizer and chat template of a Hugging Face model directory
(or of a GGUF file's metadata: daemon/gguf_tokenizer.py).

Wraps `tokenizers.Tokenizer.from_file("tokenizer.json")` (Qwen has no BOS: encoding never adds
special tokens), renders `chat_template.jinja` or `tokenizer_config.json["chat_template"]` in a
sandboxed Jinja2 environment configured like transformers', and reads EOS ids from
`generation_config.json` (falling back to tokenizer_config.json's `eos_token`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.gguf_tokenizer import GGUFTokenizerError, read_gguf_tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class TokenizerError(ValueError):
    """Missing or unusable tokenizer files, or a chat template that cannot be rendered."""


class MissingTokenizerError(TokenizerError):
    """The model directory has no tokenizer.json (the model is usable with token ids only)."""


class Tokenizer:
    """Text <-> token ids for one model directory, plus its chat template and EOS ids."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 eos_token_ids: Sequence[int] = (), template_tokens: dict[str, str] | None = None,
                 source: str = "<memory>") -> None:
        self.backend = backend
        self.source = source
        self.eos_token_ids: list[int] = list(eos_token_ids)
        # bos_token / eos_token / pad_token / unk_token strings the template may use
        self.template_tokens = dict(template_tokens or {})
        # special added tokens (e.g. <|im_end|>), content -> id
        self.special_tokens: dict[str, int] = {
            tok.content: i for i, tok in sorted(backend.get_added_tokens_decoder().items())
            if tok.special}
        self.chat_template = chat_template
        self._plain: tokenizers.Tokenizer | None = None  # encode_plain's copy (lazily)
        self._template = _compile(chat_template, source) if chat_template is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat template and generation_config.json.

        Raises MissingTokenizerError when there is no tokenizer.json, TokenizerError when a file
        is unreadable or invalid.
        """
        root = Path(path)
        if root.name.endswith(".gguf"):  # a GGUF file: its tokenizer.ggml.* metadata
            try:
                return cls(**read_gguf_tokenizer(root), source=str(root))
            except GGUFTokenizerError as exc:
                raise MissingTokenizerError(str(exc)) from None
        file = root / "tokenizer.json"
        if not file.is_file():
            raise MissingTokenizerError(f"{file}: no tokenizer in this model directory")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise TokenizerError(f"{file}: cannot load tokenizer: {exc}") from None
        config = _json_object(root / "tokenizer_config.json")
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{template_file}: cannot read: {exc}") from None
            source = str(template_file)
        else:
            template = _config_template(config, root / "tokenizer_config.json")
            source = str(root / "tokenizer_config.json")
        eos = _eos_ids(root, config, backend)
        tokens = {key: _token_text(config.get(key))
                  for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(backend, chat_template=template, eos_token_ids=eos, source=source,
                   template_tokens={k: v for k, v in tokens.items() if v is not None})

    # ---- text <-> ids --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text (e.g. `<|im_start|>`) becomes that token."""
        return self.backend.encode(_valid(text), add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text encoded as ordinary text."""
        if self._plain is None:
            self._plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
        return self._plain.encode(_valid(text), add_special_tokens=False).ids

    def encode_chat(self, messages: Sequence[dict[str, Any]], *,
                    tools: Sequence[dict[str, Any]] | None = None,
                    enable_thinking: bool | None = None) -> list[int]:
        """The prompt ids of a chat (generation prompt added). Special-token text that the
        client typed (in contents, names, tool calls, tool definitions) stays text: it
        cannot open a turn or a role of its own (role injection)."""
        return self._chat_ids(messages, tools, enable_thinking, generation=True)

    def chat_history_len(self, ids: Sequence[int], messages: Sequence[dict[str, Any]], *,
                         tools: Sequence[dict[str, Any]] | None = None,
                         enable_thinking: bool | None = None) -> int | None:
        """How many of ``ids`` (:meth:`encode_chat`'s) the conversation's next turn will
        begin with: the messages rendered without the generation prompt, where that is a
        shorter prefix of ``ids``; else None. The next turn appends the answer as the
        template renders it (e.g. without the empty thinking block a Qwen3 generation
        prompt opens), so the whole prompt is never its prefix; the scheduler checkpoints
        here (daemon/scheduler.py)."""
        try:
            history = self._chat_ids(messages, tools, enable_thinking, generation=False)
        except TokenizerError:
            return None
        n = len(history)
        return n if 0 < n < len(ids) and list(ids[:n]) == history else None

    def _chat_ids(self, messages, tools, enable_thinking, *, generation: bool) -> list[int]:
        found: list[str] = []
        nonce = secrets.token_hex(4)
        defuse = _Defuser(self.special_tokens, nonce, found)
        text = self.apply_chat_template(defuse(list(messages)),
                                        add_generation_prompt=generation,
                                        tools=defuse(list(tools)) if tools else None,
                                        enable_thinking=enable_thinking)
        if not found:
            return self.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", text)):
            if i % 2:  # a marker: the special-token text it stands for, as text
                ids += self.encode_plain(found[int(piece)])
            elif piece:
                ids += self.encode(piece)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None,
                            enable_thinking: bool | None = None, **extra: Any) -> str:
        """Render `messages` (dicts with `role` and `content`) to the prompt text."""
        if self._template is None:
            raise TokenizerError(f"{self.source}: this model has no chat template")
        if not isinstance(messages, Sequence) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise TokenizerError("messages must be a non-empty list of objects with a 'role'")
        context: dict[str, Any] = {
            "bos_token": None, "eos_token": None, **self.template_tokens, **extra,
            "messages": list(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt}
        if enable_thinking is not None:  # absent -> `enable_thinking is defined` is false
            context["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{self.source}: chat template error: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            # the template met a value of a shape it cannot render (e.g. a missing field)
            raise TokenizerError(f"the chat template cannot render these messages: "
                                 f"{type(exc).__name__}: {exc}") from None


class _Defuser:
    """Copies of messages/tools in which every special-token text inside a string is
    replaced by a marker `\ue000<nonce>:<k>\ue001` (found[k] is the text it stands for)."""

    def __init__(self, specials: dict[str, int], nonce: str, found: list[str]) -> None:
        self.nonce, self.found = nonce, found
        self.pattern = (re.compile("|".join(map(re.escape, sorted(specials, key=len,
                                                                  reverse=True))))
                        if specials else None)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.pattern.sub(self._mark, value) if self.pattern else value
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def _mark(self, match: re.Match[str]) -> str:
        self.found.append(match.group(0))
        return f"\ue000{self.nonce}:{len(self.found) - 1}\ue001"


def _valid(text: str) -> str:
    """`text`, if it can be encoded (UTF-8); TokenizerError for an unpaired surrogate."""
    if not isinstance(text, str):
        raise TokenizerError(f"expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise TokenizerError(f"the text contains an unpaired UTF-16 surrogate "
                             f"(U+{ord(bad):04X} at character {exc.start}): it is not valid "
                             f"Unicode") from None
    return text


class IncrementalDetokenizer:
    """Streaming text of a growing token sequence.

    `add(ids)` returns the text that became final with these tokens (possibly ""); it never
    ends inside a UTF-8 character. `flush()` returns what is left at the end of the stream.
    The concatenation of all returned pieces equals `Tokenizer.decode` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False,
                 use_decode_stream: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if use_decode_stream and DecodeStream is not None else None)
        self._prefix = 0  # fallback (prefix-offset) state: ids[_prefix:_read] already emitted
        self._read = 0

    def add(self, ids: int | Sequence[int]) -> str:
        new = [ids] if isinstance(ids, int) else list(ids)
        if not new:
            return ""
        self.ids.extend(new)
        if self._stream is not None:
            piece = self._stream.step(self._tok.backend, new) or ""
        else:
            piece = self._step_fallback()
        self.text += piece
        return piece

    def flush(self) -> str:
        """The rest of the text at end of stream (an incomplete character decodes as U+FFFD)."""
        full = self._tok.decode(self.ids, skip_special_tokens=self._skip)
        if not full.startswith(self.text):  # cannot happen for byte-level BPE; be loud
            raise TokenizerError("incremental decode diverged from full decode")
        rest = full[len(self.text):]
        self.text = full
        return rest

    def _step_fallback(self) -> str:
        decode = self._tok.backend.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(self.ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


# ---- files ---------------------------------------------------------------------------------
def _json_object(file: Path) -> dict[str, Any]:
    """A JSON object file ({} when absent); an unreadable one raises TokenizerError."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{file}: cannot parse JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return data


def _config_template(config: dict[str, Any], file: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{file}: chat_template must be a string")
    return template


def _eos_ids(root: Path, config: dict[str, Any], backend: tokenizers.Tokenizer) -> list[int]:
    gen_file = root / "generation_config.json"
    eos = _json_object(gen_file).get("eos_token_id")
    if eos is not None:
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TokenizerError(f"{gen_file}: eos_token_id must be an integer or a list of "
                                 f"integers, got {eos!r}")
        return ids
    token = _token_text(config.get("eos_token"))
    if token is None:
        return []
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"{root / 'tokenizer_config.json'}: eos_token {token!r} is not in "
                             f"the vocabulary")
    return [token_id]


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return token if isinstance(token, str) else None


# ---- chat template environment (as transformers renders chat templates) -----------------------
def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str, where: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"{where}: chat template syntax error at line {exc.lineno}: "
                             f"{exc.message}") from None
