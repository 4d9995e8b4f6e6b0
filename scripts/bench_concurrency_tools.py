"""The coding workload's tools and its scripted agent (scripts/bench_concurrency.py).

A small model never calls tools, so the agent's tool calls are scripted: each turn the model
writes (its text is the turn's reasoning and code), then the harness makes the turn's call in
its name and executes it for real in a scratch directory, and the result joins the context.
The script per loop, six turns: read a project file (2-8 kB), write the module (the model's
own text of that turn), run the check (its error output comes back), read a second project
file, write the module again, check again. Contexts grow as an agent's do: ~2-8 kB of file
per read, the model's text, compiler errors.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write (replace) a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_check", "description": "Byte-compile and import a Python file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
]
SCRIPT = ("read_file", "write_file", "run_check", "read_file", "write_file", "run_check")
FILE_BYTES = (2048, 8192)  # project files the agent reads: sizes drawn in this range
WORDS = ("cache", "entry", "value", "index", "parse", "merge", "field", "count", "block",
         "token", "state", "batch", "order", "range", "items", "queue", "owner", "store")


def project_file(seed: int, sizes: tuple[int, int] = FILE_BYTES) -> tuple[str, str]:
    """A deterministic Python module of ``sizes`` bytes, 2-8 kB by default (name, text):
    functions with docstrings and bodies, the kind of file a coding agent reads."""
    rng = random.Random(seed)
    size = rng.randint(*sizes)
    name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{seed}.py"
    parts = [f'"""Helpers for the {name[:-3].replace("_", " ")} module."""\n\n'
             "from __future__ import annotations\n\n"]
    n = 0
    while sum(map(len, parts)) < size:
        a, b, c = rng.sample(WORDS, 3)
        n += 1
        parts.append(
            f"\ndef {a}_{b}_{n}({c}: list[int], limit: int = {rng.randint(2, 64)}) -> int:\n"
            f'    """Return the {b} of the first ``limit`` {c} items ({a} order)."""\n'
            f"    total = 0\n    for i, x in enumerate({c}[:limit]):\n"
            f"        if x % {rng.randint(2, 9)} == {rng.randint(0, 1)}:\n"
            f"            total += x * {rng.randint(1, 7)} - i\n    return total\n")
    return name, "".join(parts)[:size]


def setup_project(workdir: Path, loop: int, sizes: tuple[int, int] = FILE_BYTES) -> list[str]:
    """Write the two project files loop ``loop`` reads; returns their names."""
    names = []
    for k in range(2):
        name, text = project_file(1000 * loop + k, sizes)
        (workdir / name).write_text(text)
        names.append(name)
    return names


def scripted_call(turn: int, loop: int, module: str, files: list[str], text: str) -> dict:
    """The tool call the agent makes after turn ``turn`` (OpenAI ``tool_calls`` entry);
    ``text`` is the model's answer of that turn (written by ``write_file``)."""
    name = SCRIPT[turn % len(SCRIPT)]
    args: dict[str, str] = {"path": module}
    if name == "read_file":
        args["path"] = files[(turn // 3) % len(files)]
    elif name == "write_file":
        args["content"] = text
    return {"id": f"call_{loop}_{turn}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def run_tool(workdir: Path, name: str, arguments: str) -> str:
    """Execute one tool call in ``workdir``; the result text goes back to the model."""
    try:
        args = json.loads(arguments)
        path = workdir / Path(str(args["path"])).name  # no way out of the scratch directory
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"error: bad arguments ({exc})"
    if name == "read_file":
        return path.read_text() if path.exists() else f"error: {path.name} does not exist"
    if name == "write_file":
        content = str(args.get("content", ""))
        path.write_text(content)
        return f"wrote {len(content)} characters to {path.name}"
    if name == "run_check":
        if not path.exists():
            return f"error: {path.name} does not exist"
        try:
            p = subprocess.run([sys.executable, "-c", "import runpy, sys; "
                                "runpy.run_path(sys.argv[1])", str(path)],
                               capture_output=True, text=True, timeout=10, cwd=workdir)
        except subprocess.TimeoutExpired:
            return "error: the import did not finish within 10 s"
        # the scratch directory's random name out of the text: every arm's agent must see
        # the same bytes (the replay arms' prompts are the plain run's)
        return "ok" if p.returncode == 0 else \
            p.stderr.replace(str(workdir), "/project")[-2000:]
    return f"error: no tool named {name!r}"
