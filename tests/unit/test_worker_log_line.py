"""The GPU worker's log lines share a file with the daemon's: each must reach it in one
write, line and newline together, or another process's line can land in between (seen once:
the worker's "cpu expert worker ready" and the daemon's access line on one line)."""

from __future__ import annotations

import json
import sys

from gpu_worker import server


class _Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_log_line_is_one_write_with_its_newline(monkeypatch):
    out = _Writes()
    monkeypatch.setattr(sys, "stderr", out)
    server._log("cpu expert worker ready", placement="split", workers=2)
    assert len(out.calls) == 1 and out.calls[0].endswith("\n")
    line = json.loads(out.calls[0])
    assert line == {"event": "cpu expert worker ready", "logger": "tandem.gpu_worker",
                    "level": "info", "placement": "split", "workers": 2}
