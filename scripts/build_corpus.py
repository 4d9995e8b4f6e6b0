#!/usr/bin/env python3
"""Build the tandem-tiny training corpus from what every Python install has.

Sources (all from the running interpreter's standard library, PSF License):

* ``code``  - the ``.py`` files of the standard library (tests included), and those of the
  pip and setuptools wheels the stdlib bundles for ``ensurepip`` (``ensurepip/_bundled/*.whl``,
  pip's vendored libraries included; train split only, see :func:`iter_wheels`),
* ``prose`` - module/class/function docstrings and the ``pydoc_data.topics`` texts,
* ``func``  - (train split only) each documented function of the train split as a document of
  its own: signature, cleaned docstring and body, the format of the compile-rate prompts,
* ``chat``  - chat-formatted examples derived from the same material, rendered exactly as
  ``models/tandem-tiny/chat_template.jinja`` renders them (Qwen3 format): docstring -> code,
  explain-this-code, and tool-call conversations (read_file / write_file / check_python)
  in Qwen3's ``<tool_call>`` format.

The split is by module and deterministic: a file's *split key* (its top-level package, or for
``test.test_foo`` the name ``foo``) is hashed with SHA-256; keys whose hash falls in the
held-out bucket go to ``heldout``. Documents are deduplicated on whitespace-normalised text.
Everything is deterministic (sorted walk, seeded RNG), so the same interpreter gives the
same bytes.

Outputs in ``--out DIR``: ``train.jsonl``, ``heldout.jsonl`` (one ``{"kind", "key", "text"}``
per line), ``heldout_functions.jsonl`` (held-out functions with signature + docstring prompt
and reference body, for a compile-rate check) and ``manifest.json`` (counts and hashes).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_BUCKETS = 1000
HELDOUT_PERMILLE = 80  # about 8 % of split keys
SPLIT_SALT = "tandem-tiny-v1"
SKIP_DIRS = {"site-packages", "__pycache__", "dist-packages"}
MAX_FILE_CHARS = 200_000
MIN_FUNC_CHARS = 60
MAX_FUNC_CHARS = 2_400
# Bundled wheels: a file is skipped when it is mostly data (letters under this share of its
# non-blank characters: chardet's frequency tables, idna's Unicode tables) or when this share
# of its distinct lines (of at least WHEEL_LINE_CHARS characters) also occurs in held-out stdlib
# code (setuptools._distutils is distutils, zipp is zipfile.Path, setuptools/glob.py is glob).
WHEEL_MIN_LETTERS = 0.5
WHEEL_MAX_HELDOUT_OVERLAP = 0.1
WHEEL_LINE_CHARS = 30
WHEEL_KEY_PREFIX = "wheel:"

SYSTEM_DEFAULT = "You are a helpful assistant."

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file and return its contents.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path of the file."}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file, replacing it.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path of the file."},
                    "content": {"type": "string", "description": "The new contents."},
                },
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "check_python",
            "description": "Compile a Python file and report syntax errors.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path of the file."}},
                "required": ["path"],
            },
        },
    },
]


# --------------------------------------------------------------------------- chat rendering


def render_chat(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Render a conversation exactly as the Qwen3 chat template does (no generation prompt).

    Assistant turns after the last real user query get the (empty) ``<think>`` block when they
    are the last turn, as the template does; ``tests/unit/test_corpus.py`` checks this function
    against ``chat_template.jinja``.
    """
    out: list[str] = []
    if tools:
        out.append("<|im_start|>system\n")
        if messages and messages[0]["role"] == "system":
            out.append(messages[0]["content"] + "\n\n")
        out.append(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        for tool in tools:
            out.append("\n" + json.dumps(tool, ensure_ascii=False))
        out.append(
            "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
            "<|im_end|>\n"
        )
    elif messages and messages[0]["role"] == "system":
        out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] == "user" and not (
            m["content"].startswith("<tool_response>") and m["content"].endswith("</tool_response>")
        ):
            last_query = i
            break
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "user" or (role == "system" and i != 0):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1]
                reasoning = reasoning.lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                out.append(
                    "<|im_start|>assistant\n<think>\n" + reasoning.strip("\n")
                    + "\n</think>\n\n" + content.lstrip("\n")
                )
            else:
                out.append("<|im_start|>assistant\n" + content)
            for j, call in enumerate(m.get("tool_calls") or []):
                if (j == 0 and content) or j > 0:
                    out.append("\n")
                fn = call.get("function", call)
                args = fn["arguments"]
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                out.append('<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args
                           + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
    return "".join(out)


# --------------------------------------------------------------------------- source walking


@dataclass(frozen=True)
class SourceFile:
    path: Path
    rel: str  # e.g. "json/decoder.py"
    module: str  # e.g. "json.decoder"
    key: str  # split key
    shown: str = ""  # the path chat examples show; default "Lib/" + rel

    @property
    def display_path(self) -> str:
        return self.shown or f"Lib/{self.rel}"


def split_key(module: str) -> str:
    """The unit the held-out split is drawn by: the top-level package (tests go with it)."""
    parts = module.split(".")
    if parts[0] == "test" and len(parts) > 1:
        name = parts[1]
        name = name[len("test_"):] if name.startswith("test_") else name
        return name.split("_")[0] or "test"
    if parts[0] == "idlelib":
        return "idlelib"
    return parts[0].lstrip("_") or parts[0]


def is_heldout(key: str) -> bool:
    """The key's salted hash falls in the held-out buckets; bundled-wheel keys never do."""
    if key.startswith(WHEEL_KEY_PREFIX):
        return False
    digest = hashlib.sha256(f"{SPLIT_SALT}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS < HELDOUT_PERMILLE


def iter_stdlib(root: Path) -> Iterator[SourceFile]:
    paths = []
    for p in root.rglob("*.py"):
        rel_parts = p.relative_to(root).parts
        if any(part in SKIP_DIRS for part in rel_parts):
            continue
        paths.append(p)
    for p in sorted(paths, key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        mod = rel[:-3].replace("/", ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        yield SourceFile(p, rel, mod, split_key(mod))


def decode_source(raw: bytes) -> str | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in text or len(text) > MAX_FILE_CHARS or not text.strip():
        return None
    return text.replace("\r\n", "\n")


def read_source(path: Path) -> str | None:
    try:
        return decode_source(path.read_bytes())
    except OSError:
        return None


def long_lines(text: str) -> set[str]:
    """Distinct stripped lines of at least WHEEL_LINE_CHARS characters (overlap checks)."""
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= WHEEL_LINE_CHARS}


def is_mostly_data(text: str) -> bool:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) < WHEEL_MIN_LETTERS * len(chars)


def iter_wheels(root: Path) -> Iterator[tuple[SourceFile, str]]:
    """(file, text) for the ``.py`` files of ``root/ensurepip/_bundled/*.whl`` (sorted).

    Their split key is ``wheel:<distribution>:<top-level package>`` and they always go to the
    train split: the held-out split stays the stdlib's own, unchanged by them. The caller drops
    files that copy held-out stdlib code."""
    import zipfile

    for whl in sorted((root / "ensurepip" / "_bundled").glob("*.whl")):
        dist = whl.name.split("-")[0]
        with zipfile.ZipFile(whl) as zf:
            names = sorted(n for n in zf.namelist() if n.endswith(".py"))
            for rel in names:
                text = decode_source(zf.read(rel))
                if text is None:
                    continue
                mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
                key = f"{WHEEL_KEY_PREFIX}{dist}:{mod.split('.')[0]}"
                yield SourceFile(whl, rel, mod, key, shown=rel), text


# --------------------------------------------------------------------------- extraction


@dataclass
class Func:
    name: str
    qualname: str
    signature: str  # "def name(args) -> ret:"
    doc: str
    source: str  # dedented, decorators included
    body_without_doc: str  # dedented source with the docstring removed
    after_doc: str = ""  # the body after the docstring, indented as in ``source``


def _signature_line(src: str) -> str:
    """The def line(s) up to the colon that ends the header."""
    lines = src.splitlines()
    start = 0
    while start < len(lines) and lines[start].lstrip().startswith("@"):
        start += 1
    header = []
    for line in lines[start:]:
        header.append(line)
        try:
            ast.parse("\n".join(header) + "\n    pass\n")
            return "\n".join(header)
        except SyntaxError:
            if len(header) > 12:
                break
    return lines[start] if start < len(lines) else ""


def extract_functions(text: str) -> tuple[str | None, list[Func], list[tuple[str, str]]]:
    """Module docstring, functions with docstrings, and (class name, docstring) pairs."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None, [], []
    lines = text.splitlines()
    funcs: list[Func] = []
    classes: list[tuple[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                doc = ast.get_docstring(child)
                if doc:
                    classes.append((prefix + child.name, doc))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(child)
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                seg = "\n".join(lines[first - 1 : child.end_lineno])
                src = textwrap.dedent(seg)
                if doc and MIN_FUNC_CHARS <= len(src) <= MAX_FUNC_CHARS:
                    ds = child.body[0]
                    keep = lines[first - 1 : ds.lineno - 1]
                    n_head = len(keep)
                    keep += lines[ds.end_lineno : child.end_lineno]
                    body = textwrap.dedent("\n".join(keep))
                    if body.strip() and len(child.body) > 1:
                        after = "\n".join(body.split("\n")[n_head:])
                        funcs.append(
                            Func(child.name, prefix + child.name, _signature_line(src), doc, src,
                                 body, after)
                        )

    visit(tree, "")
    return ast.get_docstring(tree), funcs, classes


def function_prompt(f: Func) -> str:
    """Signature + cleaned docstring: the compile-rate prompt of a held-out function."""
    doc = textwrap.indent('"""' + inspect.cleandoc(f.doc) + '\n"""', "    ")
    return f.signature + "\n" + doc + "\n"


def function_document(f: Func) -> str | None:
    """A train function as a document of its own: its compile-rate prompt, then its body."""
    body = f.after_doc.rstrip()
    return function_prompt(f) + body.lstrip("\n") + "\n" if body.strip() else None


def doc_summary(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(para.split())


_ES_ENDINGS = ("s", "sh", "ch", "x", "z")


def third_person(summary: str) -> str | None:
    """'Return the sum.' -> 'returns the sum' (None when the summary is no imperative)."""
    m = re.match(r"([A-Z][a-z]+)\b(.*)$", summary)
    if not m:
        return None
    verb, rest = m.group(1), m.group(2)
    if verb in {"The", "A", "An", "This", "These", "If", "For", "Used", "Internal", "Helper",
                "Private", "Like", "Same", "Deprecated", "Note", "See", "Called", "Return's"}:
        return None
    low = verb.lower()
    if low.endswith("y") and low[-2:-1] not in "aeiou":
        low = low[:-1] + "ies"
    elif low.endswith(_ES_ENDINGS):
        low += "es"
    elif low.endswith("s"):
        return None
    else:
        low += "s"
    out = low + rest
    return out.rstrip(".")


def code_block(src: str) -> str:
    return f"```python\n{src.rstrip()}\n```"


def chat_examples(sf: SourceFile, funcs: list[Func], rng: random.Random) -> Iterator[str]:
    """Chat documents derived from one file's documented functions."""
    picked = funcs if len(funcs) <= 12 else rng.sample(funcs, 12)
    for f in picked:
        summary = doc_summary(f.doc)
        if not summary:
            continue
        full_doc = inspect.cleandoc(f.doc)
        sys_msg = [{"role": "system", "content": SYSTEM_DEFAULT}] if rng.random() < 0.3 else []
        # 1. docstring -> code
        tp = third_person(summary)
        choice = rng.random()
        sig = f.signature.strip().removeprefix("async ").removeprefix("def ").rstrip(":")
        if tp and choice < 0.5:
            prompt = f"Write a Python function that {tp}."
            if rng.random() < 0.5:
                prompt += f" Call it `{f.name}`."
        elif choice < 0.75:
            prompt = f"Implement `{sig}` in Python.\n\n{full_doc}"
        else:
            prompt = f"{summary}\n\nWrite this as a Python function named `{f.name}`."
        answer = code_block(f.source)
        if rng.random() < 0.4:
            answer = f"Here is `{f.name}`:\n\n{answer}"
        msgs = sys_msg + [{"role": "user", "content": prompt},
                          {"role": "assistant", "content": answer}]
        yield render_chat(msgs)
        # 2. explain this code
        if rng.random() < 0.5:
            ask = rng.choice(["Explain what this code does:", "What does this function do?",
                              "Describe this Python function briefly."])
            msgs = sys_msg + [
                {"role": "user", "content": f"{ask}\n\n{code_block(f.body_without_doc)}"},
                {"role": "assistant", "content": f"`{f.name}`: {full_doc}"},
            ]
            yield render_chat(msgs)
        # 3. tool calls
        r = rng.random()
        if r < 0.15:
            msgs = [
                {"role": "user", "content": f"What does `{f.qualname}` in `{sf.display_path}` do?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"name": "read_file",
                                 "arguments": {"path": sf.display_path}}]},
                {"role": "tool", "content": f.source},
                {"role": "assistant", "content": f"`{f.qualname}`: {summary}"},
            ]
            yield render_chat(msgs, TOOLS)
        elif r < 0.3:
            fname = f"{f.name.strip('_') or 'func'}.py"
            code = f.source.rstrip() + "\n"
            msgs = [
                {"role": "user",
                 "content": f"Write a Python function `{f.name}`: {summary} Save it to "
                            f"`{fname}` and check that it compiles."},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"name": "write_file",
                                 "arguments": {"path": fname, "content": code}}]},
                {"role": "tool", "content": f"wrote {len(code.encode())} bytes to {fname}"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"name": "check_python", "arguments": {"path": fname}}]},
                {"role": "tool", "content": f"OK: {fname} compiles"},
                {"role": "assistant",
                 "content": f"Done: `{f.name}` is in `{fname}` and it compiles."},
            ]
            yield render_chat(msgs, TOOLS)


def prose_for_module(sf: SourceFile, mod_doc: str | None, funcs: list[Func],
                     classes: list[tuple[str, str]]) -> str | None:
    parts = []
    if mod_doc:
        parts.append(f"{sf.module}\n{'=' * len(sf.module)}\n\n{inspect.cleandoc(mod_doc)}")
    for name, doc in classes:
        parts.append(f"class {sf.module}.{name}\n\n{inspect.cleandoc(doc)}")
    for f in funcs:
        parts.append(f"{sf.module}.{f.qualname}\n\n{inspect.cleandoc(f.doc)}")
    text = "\n\n".join(parts)
    return text if len(text) >= 200 else None


# --------------------------------------------------------------------------- driver


def normalise(text: str) -> str:
    return " ".join(text.split())


def build(out: Path, stdlib: Path | None = None, seed: int = 0, wheels: bool = True,
          functions: bool = True) -> dict:
    """Build the corpus into ``out``; returns the manifest.

    The stdlib part comes first and is byte-identical with or without ``wheels`` and
    ``functions``; the bundled wheels' documents follow it in the train split, then (kind
    ``func``, train split only) every documented train function as a document of its own, in
    the held-out compile-rate prompt's format: signature, cleaned docstring, body."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    counts: dict[str, dict[str, list[int]]] = {"train": {}, "heldout": {}}
    files = {s: open(out / f"{s}.jsonl", "w", encoding="utf-8") for s in counts}
    heldout_funcs = open(out / "heldout_functions.jsonl", "w", encoding="utf-8")

    heldout_lines: set[str] = set()
    func_docs: list[tuple[str, str]] = []
    skipped: dict[str, int] = {"data": 0, "heldout_overlap": 0}

    def emit(kind: str, key: str, text: str) -> None:
        h = hashlib.sha256(normalise(text).encode()).hexdigest()
        if h in seen:
            return
        seen.add(h)
        split = "heldout" if is_heldout(key) else "train"
        if split == "heldout" and kind == "code":
            heldout_lines.update(long_lines(text))
        files[split].write(json.dumps({"kind": kind, "key": key, "text": text}) + "\n")
        c = counts[split].setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += len(text)

    def emit_module(sf, text: str) -> list:
        """The code, prose and chat documents of one source file; returns its functions."""
        emit("code", sf.key, text)
        mod_doc, funcs, classes = extract_functions(text)
        prose = prose_for_module(sf, mod_doc, funcs, classes)
        if prose:
            emit("prose", sf.key, prose)
        for chat in chat_examples(sf, funcs, rng):
            emit("chat", sf.key, chat)
        return funcs

    try:
        for sf in iter_stdlib(root):
            text = read_source(sf.path)
            if text is None:
                continue
            funcs = emit_module(sf, text)
            if is_heldout(sf.key) and not sf.module.startswith(("test.", "idlelib.idle_test")):
                for f in funcs:
                    if f.name.startswith("_"):
                        continue
                    heldout_funcs.write(json.dumps({
                        "module": sf.module, "name": f.name, "prompt": function_prompt(f),
                        "source": f.source}) + "\n")
            if not is_heldout(sf.key):
                func_docs += [(sf.key, d) for d in map(function_document, funcs) if d]
        try:
            from pydoc_data.topics import topics
        except ImportError:  # pragma: no cover - every CPython has it
            topics = {}
        for name in sorted(topics):
            emit("prose", f"pydoc:{name}", topics[name].strip())
        for sf, text in iter_wheels(root) if wheels else ():
            lines = long_lines(text)
            if is_mostly_data(text):
                skipped["data"] += 1
                continue
            if len(lines & heldout_lines) > WHEEL_MAX_HELDOUT_OVERLAP * len(lines):
                skipped["heldout_overlap"] += 1
                continue
            funcs = emit_module(sf, text)
            func_docs += [(sf.key, d) for d in map(function_document, funcs) if d]
        # Last, so that everything above is the same with or without them (train keys only).
        for key, doc in func_docs if functions else ():
            emit("func", key, doc)
    finally:
        for fh in files.values():
            fh.close()
        heldout_funcs.close()
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "split_salt": SPLIT_SALT,
        "heldout_permille": HELDOUT_PERMILLE,
        "seed": seed,
        "functions": functions,
        "wheels": sorted(p.name for p in (root / "ensurepip" / "_bundled").glob("*.whl"))
        if wheels else [],
        "wheel_files_skipped": skipped,
        "counts": {s: {k: {"docs": v[0], "chars": v[1]} for k, v in c.items()}
                   for s, c in counts.items()},
        "sha256": {
            name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("train.jsonl", "heldout.jsonl", "heldout_functions.jsonl")
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib root (default: this one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-wheels", action="store_true",
                    help="no ensurepip wheels (with --no-functions: the first model's corpus)")
    ap.add_argument("--no-functions", action="store_true", help="no 'func' documents")
    args = ap.parse_args(argv)
    manifest = build(args.out, args.stdlib, args.seed, wheels=not args.no_wheels,
                     functions=not args.no_functions)
    print(json.dumps(manifest["counts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
