"""Chat documents of the corpus: conversations derived from documented functions (docstring ->
code, explain-this-code, tool calls), rendered exactly as
``models/tandem-tiny/chat_template.jinja`` renders them (Qwen3 format)."""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Iterator

from scripts.corpus_functions import Func, doc_summary
from scripts.corpus_sources import SourceFile

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


