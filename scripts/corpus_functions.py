"""Documented functions of a source file: extraction (``ast``), the compile-rate prompt
(signature + cleaned docstring) and the train split's function documents."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

MIN_FUNC_CHARS = 60
MAX_FUNC_CHARS = 2_400


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

