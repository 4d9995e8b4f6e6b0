"""The compile check of issue 5's compile rate, shared by ``eval_tiny_model.py`` (Tandem's
figures) and ``train_tiny_model.py`` (validation while fine-tuning): one rule, one place."""

from __future__ import annotations

import warnings


def compiles(prompt: str, body: str) -> bool:
    """``compile(signature + docstring + body + '\\n', 'exec')`` succeeds for a non-blank
    body."""
    if not body.strip():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(prompt + body + "\n", "<heldout>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True
