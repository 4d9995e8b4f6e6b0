"""What a step asks of the device, recorded on the fake CuPy: ``with audit() as a:`` counts
every kernel launch and array operation that would launch one, every device->host transfer or
synchronisation and every host->device upload (with the worker's line that caused it), and
every allocation. These are what a CUDA graph capture refuses or freezes (issue 14): a sync
or a pageable upload fails the capture, an allocation or a host-built argument bakes one
step's addresses and values into the graph.

Off (the default) it costs one attribute test per hook: the fake's hooks call
:func:`active` and do nothing when it returns None."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from collections.abc import Iterator

# a frame's function name -> the part of the step it belongs to (the innermost match wins)
KINDS = {"full_attention": "attention", "gated_deltanet": "gdn", "sparse_moe": "moe",
         "moe_norm": "moe", "dense_mlp": "mlp", "_layer": "layer norms/residuals",
         "mtp_forward": "mtp", "sample_and_match_all": "sampling",
         "sample_and_match": "sampling"}
# functions named "forward"/"draft" count by the file they are in
FILE_KINDS = {"model/model.py": "embed/rope/head", "mtp_drafter.py": "mtp",
              "cache_ops.py": "cache ops", "states.py": "states", "runner.py": "runner"}
_HERE = "scripts/cuda_emu/"
_SKIP_FILES = ("scripts/cuda_emu/", "/contextlib.py", "/numpy/")

_ACTIVE: Audit | None = None


def active() -> Audit | None:
    """The recording audit, or None (the hooks' fast path)."""
    return _ACTIVE


@dataclasses.dataclass
class Audit:
    """What the device was asked during the ``with`` block. Keys of the counters:
    launches (kind, name); syncs and uploads (what, call site); allocations (call site)."""

    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    syncs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    uploads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    upload_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    allocs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    alloc_bytes: int = 0
    depth: int = 0  # > 0 inside a fake function whose own steps are not the caller's

    # ---- recording (the fake's hooks) ---------------------------------------------------
    def launch(self, name: str) -> None:
        if not self.depth:
            self.launches[(kind_of_stack(), name)] += 1

    def sync(self, what: str) -> None:
        if not self.depth:
            self.syncs[(what, call_site())] += 1

    def upload(self, what: str, nbytes: int) -> None:
        if not self.depth:
            key = (what, call_site())
            self.uploads[key] += 1
            self.upload_bytes[key] += nbytes

    def alloc(self, nbytes: int) -> None:
        self.allocs[call_site()] += 1
        self.alloc_bytes += nbytes

    @contextlib.contextmanager
    def inner(self) -> Iterator[None]:
        """The fake's own calls inside one emulated operation are not recorded."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    # ---- reading ------------------------------------------------------------------------
    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def num_allocs(self) -> int:
        return sum(self.allocs.values())

    def launches_by_kind(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for (kind, _), n in self.launches.items():
            out[kind] += n
        return dict(out.most_common())

    def sync_sites(self) -> list[str]:
        return [site for (_, site) in self.syncs]


@contextlib.contextmanager
def audit() -> Iterator[Audit]:
    """Record what the fake CuPy is asked inside the block (not nestable)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("an audit is already recording")
    _ACTIVE = Audit()
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = None


def _frames():
    f = sys._getframe(2)
    while f is not None:
        yield f
        f = f.f_back


def call_site() -> str:
    """``gpu_worker/FILE.py:LINE (function)`` of the innermost worker frame on the stack;
    else the innermost frame outside the emulator."""
    fallback = None
    for f in _frames():
        name = f.f_code.co_filename.replace("\\", "/")
        at = name.rfind("/gpu_worker/")
        if at >= 0:
            return f"{name[at + 1:]}:{f.f_lineno} ({f.f_code.co_name})"
        if fallback is None and not any(s in name for s in _SKIP_FILES):
            short = name[name.rfind("/", 0, name.rfind("/")) + 1:]
            fallback = f"{short}:{f.f_lineno} ({f.f_code.co_name})"
    return fallback or "?"


def kind_of_stack() -> str:
    """The part of the step (KINDS, FILE_KINDS) the innermost worker frame belongs to."""
    for f in _frames():
        kind = KINDS.get(f.f_code.co_name)
        if kind is not None and "/gpu_worker/" in f.f_code.co_filename:
            return kind
        name = f.f_code.co_filename.replace("\\", "/")
        if "/gpu_worker/" in name:
            for suffix, kind in FILE_KINDS.items():
                if name.endswith(suffix) and f.f_code.co_name in (
                        "forward", "draft", "steps", "apply", "execute", "_pass", "adopt",
                        "verifying", "_forward", "run_all", "run"):
                    return kind
    return "other"
