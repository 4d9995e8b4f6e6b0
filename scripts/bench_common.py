"""What the benchmark scripts share: the machine they ran on, the command that ran them, one
timer, a served engine (a fresh ``tandem serve`` process) and its Prometheus counters, and the
tiny in-process engines of the GPU benchmarks.

Every ``scripts/bench_*.py`` runs from the repository root as ``python -m scripts.bench_NAME``;
``docs/benchmarks.md`` lists them and where their results go.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from scripts.procs import stop_server

if TYPE_CHECKING:
    import aiohttp

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
R = TypeVar("R")

# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first GPU's name as ``nvidia-smi`` reports it; None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return names[0].strip() if names else None


def git_tree() -> str | None:
    """The checkout measured: commit, with ``-dirty`` when the tree has uncommitted changes."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def files_tree(repo: Path = REPO) -> str | None:
    """The git tree id of the checkout's files as they are (what ``.gitignore`` keeps out
    left out): equal to ``git rev-parse COMMIT^{tree}`` where they are a commit's. A lent
    device's copy of the working tree can carry an older ``.git`` than its files (its
    ``git describe`` then names that commit, dirty); this names the files themselves."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        try:
            for cmd in (["add", "-A"], ["write-tree"]):
                done = subprocess.run(["git", *cmd], capture_output=True, text=True,
                                      timeout=120, cwd=repo, env=env)
                if done.returncode:
                    return None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return done.stdout.strip() or None


def machine() -> dict[str, Any]:
    """Where a benchmark ran: host, CPU model and cores (all / usable by this process), GPU if
    any, Python and platform, the git tree (the commit, and the files' tree id), and the
    kernel's boot id: lent machines all call themselves alike ("vm", the same CPU and GPU), so
    the boot id is what tells two of them apart when one benchmark's runs span calls."""
    return {"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "gpu": gpu_name(),
            "python": platform.python_version(), "platform": platform.platform(),
            "git": git_tree(), "files_tree": files_tree(), "boot_id": boot_id()}


def boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str | None:
    """This boot of this machine's id (Linux; None elsewhere)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def emit_json(data: dict, out: Path | None) -> None:
    """Print ``data`` as indented JSON and, with ``out``, write it there too."""
    text = json.dumps(data, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


def command_line() -> str:
    """The command that runs this process, paths below the working directory made relative."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    cwd = Path.cwd()
    for i, a in enumerate(argv):
        p = Path(a)
        if p.is_absolute() and p.is_relative_to(cwd):
            argv[i] = str(p.relative_to(cwd))
    return shlex.join(argv)


# --------------------------------------------------------------------------- timing


def timings(fn: Callable[[T], R], inputs: Iterable[T], warmup: int = 0,
            sync: Callable[[], object] | None = None) -> tuple[list[float], R | None]:
    """Wall seconds of ``fn(x)`` for each ``x`` of ``inputs`` but the first ``warmup`` (run,
    not timed), and the last result. ``sync`` (a device synchronize) runs before the clock
    starts and before it stops, so that work queued on a device is inside the interval."""
    times: list[float] = []
    out = None
    for n, x in enumerate(inputs):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        out = fn(x)
        if sync is not None:
            sync()
        if n >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def best_us(fn: Callable[[], object], reps: int = 15) -> float:
    """Microseconds of the fastest of ``reps`` calls of ``fn`` after one untimed call."""
    return min(timings(lambda _: fn(), range(reps + 1), warmup=1)[0]) * 1e6


# --------------------------------------------------------------------------- served engine


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Poll ``url``/ready until it answers 200; exit if the server dies or never gets ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server not ready")


@contextmanager
def served(config: str, port: int, speculation: str, proposer: str,
           extra: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """A fresh ``tandem serve`` process on 127.0.0.1:``port``, ready: yields (base URL, model
    id); the process is terminated on exit. ``extra``: more ``tandem serve`` flags."""
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--config", config, "--port", str(port),
           "--speculation", speculation, "--proposer", proposer, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_ready(url, proc)
        with urllib.request.urlopen(url + "/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        yield url, model
    finally:
        stop_server(proc)


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed OpenAI answer (``data: {...}`` lines), in order."""
    async for line in response.content:
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


Samples = dict[tuple[str, tuple], float]


def scrape(url: str) -> Samples:
    """Every sample of the server's /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url + "/metrics") as r:
        return parse_samples(r.read().decode())


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    """How much one sample (by name and labels) grew between two scrapes."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


# --------------------------------------------------------------------------- in-process engine

PROMPT = np.arange(3, 40) * 11 % 500  # 37 token ids that every tiny vocabulary holds


def tiny_checkpoint(arch: str, **sizes: Any) -> Path:
    """A tiny random checkpoint (seed 9, no tokenizer) in a fresh temporary directory."""
    from scripts.tiny_model import make_tiny_model

    return make_tiny_model(tempfile.mkdtemp(), arch, seed=9, tokenizer=False, **sizes)


def greedy_ms_per_token(engine: Any, tokens: int, warmup_tokens: int = 8
                        ) -> tuple[float, list[int]]:
    """Milliseconds per token of a greedy ``engine.generate`` of ``tokens`` from PROMPT (after
    an untimed one of ``warmup_tokens``; none when 0), and the tokens."""
    from protocol.messages import SamplingParams

    greedy = SamplingParams(temperature=0)
    if warmup_tokens:
        engine.generate(PROMPT, params=greedy, max_tokens=warmup_tokens)
    t0 = time.perf_counter()
    out = engine.generate(PROMPT, params=greedy, max_tokens=tokens)
    return (time.perf_counter() - t0) / tokens * 1e3, out


# a CUDA kernel that keeps one thread busy for ns nanoseconds: launches queued behind it show
# the host's own time per step (scripts/bench_step.py)
SPIN_KERNEL = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
