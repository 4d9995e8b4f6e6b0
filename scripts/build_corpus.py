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

Modules: ``corpus_sources.py`` (files and split), ``corpus_functions.py`` (documented
functions), ``corpus_chat.py`` (chat documents).

    python -m scripts.build_corpus --out .corpus
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import random
import sys
import sysconfig
from pathlib import Path

from scripts.corpus_chat import chat_examples
from scripts.corpus_functions import Func, extract_functions, function_document, function_prompt
from scripts.corpus_sources import (
    HELDOUT_PERMILLE,
    SPLIT_SALT,
    WHEEL_MAX_HELDOUT_OVERLAP,
    SourceFile,
    is_heldout,
    is_mostly_data,
    iter_stdlib,
    iter_wheels,
    long_lines,
    read_source,
)


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
