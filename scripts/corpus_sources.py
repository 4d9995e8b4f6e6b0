"""The corpus's source files: the running interpreter's standard library and the pip and
setuptools wheels it bundles, and the deterministic held-out split they are drawn into.

The split is by module: a file's *split key* (its top-level package, or for ``test.test_foo``
the name ``foo``) is hashed with SHA-256; keys whose hash falls in the held-out bucket go to
``heldout``. Bundled-wheel keys never do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_BUCKETS = 1000
HELDOUT_PERMILLE = 80  # about 8 % of split keys
SPLIT_SALT = "tandem-tiny-v1"
SKIP_DIRS = {"site-packages", "__pycache__", "dist-packages"}
MAX_FILE_CHARS = 200_000
# Bundled wheels: a file is skipped when it is mostly data (letters under this share of its
# non-blank characters: chardet's frequency tables, idna's Unicode tables) or when this share
# of its distinct lines (of at least WHEEL_LINE_CHARS characters) also occurs in held-out stdlib
# code (setuptools._distutils is distutils, zipp is zipfile.Path, setuptools/glob.py is glob).
WHEEL_MIN_LETTERS = 0.5
WHEEL_MAX_HELDOUT_OVERLAP = 0.1
WHEEL_LINE_CHARS = 30
WHEEL_KEY_PREFIX = "wheel:"


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
