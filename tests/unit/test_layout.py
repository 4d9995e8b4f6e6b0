"""The tree keeps the shape the design promises: the daemon reaches the worker only through
protocol/ (its in-process commands excepted), no import circles, small files."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "gpu_worker", "cpu_experts", "protocol", "scripts")
# the in-process commands (generate, score, expert-stats, check-config): the one room of the
# daemon that runs the model itself
DAEMON_ROOM = {"daemon.inprocess"}
MAX_LINES = 400
# kernels (CUDA source, Numba) and generated code may be longer
LONG_OK = {"cpu_experts/kernels.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import of a module of this repository."""
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # NOTE: the tree uses absolute imports only
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != name:
                found.append((n, id(node) in top))
    return found


MODULES = _modules()
GRAPH = {name: _imports(path, name, set(MODULES)) for name, path in MODULES.items()}


def test_the_daemon_reaches_the_worker_only_through_protocol():
    offenders = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items()
                       if name.startswith("daemon") and name not in DAEMON_ROOM
                       for dep, _ in deps if dep.startswith(("gpu_worker", "cpu_experts")))
    assert not offenders, offenders
    assert set(DAEMON_ROOM) <= set(MODULES), "the in-process commands' room moved"


def test_no_import_circles():
    """Not even through imports inside functions; a package's __init__ importing its own
    modules does not count."""
    graph = {n: {d for d, _ in deps} for n, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if n.startswith(d + "."):
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


@pytest.mark.parametrize("pkg", [*PACKAGES, "tests"])
def test_no_file_over_the_limit(pkg):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / pkg).rglob("*.py"))
            if str(p.relative_to(ROOT)) not in LONG_OK
            and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long
