"""Run a list of checks on a lent GPU machine within a time budget, one log per check.

    python -m scripts.device_check --out "$OUT" --budget 540 [--plan kernels,load,int4]
    python -m scripts.device_check --list

Each check runs with its own timeout (a hung kernel costs that check, not the whole call),
its output goes to ``<name>.log``, and at the end every log is packed into one
``$OUT/logs.tar.gz`` beside ``$OUT/summary.json`` (name, command, exit status, seconds, last
line): the lent machines copy back only a few files from ``$OUT``. Checks are skipped once the
budget would be exceeded. ``$OUT`` is the environment variable the device tool sets.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from scripts.device_plans import PLANS, Check


def run_check(check: Check, logs: Path, env: dict[str, str], timeout: int) -> dict:
    """Run one check (its process group killed at ``timeout``); its record for the summary."""
    log = logs / f"{check.name}.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(["bash", "-c", check.command], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    lines = log.read_text(errors="replace").strip().splitlines()
    return {"name": check.name, "command": check.command, "rc": rc,
            "seconds": round(time.monotonic() - t0, 1), "last_line": lines[-1] if lines else ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    p.add_argument("--budget", type=int, default=540, help="seconds for all checks")
    p.add_argument("--plan", default="kernels,parity", help=f"of {', '.join(PLANS)}")
    p.add_argument("--list", action="store_true", help="print the plans and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, checks in PLANS.items():
            for c in checks:
                print(f"{name:8} {c.name:18} {c.timeout:4d}s  {c.command}")
        return 0
    unknown = [n for n in args.plan.split(",") if n not in PLANS]
    if unknown or args.out is None:
        p.error(f"unknown plan {unknown}" if unknown else "--out (or $OUT) is needed")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="device-check-")) / "logs"  # only the tar goes to OUT
    logs.mkdir()
    env = {**os.environ, "OUT": str(args.out), "PYTHONUNBUFFERED": "1"}
    end, done = time.monotonic() + args.budget, []
    for check in [c for n in args.plan.split(",") for c in PLANS[n]]:
        left = int(end - time.monotonic())
        if left < min(check.timeout, 30):
            done.append({"name": check.name, "command": check.command, "rc": "skipped",
                         "seconds": 0, "last_line": f"{left} s of the budget left"})
            continue
        seconds = min(check.timeout, left)  # CHECK_SECONDS: a check may fit its work to it
        done.append(run_check(check, logs, {**env, "CHECK_SECONDS": str(seconds)}, seconds))
        r = done[-1]
        print(f"{r['name']:18} rc={r['rc']!s:8} {r['seconds']:6.1f}s  {r['last_line'][:80]}",
              flush=True)
    (args.out / "summary.json").write_text(json.dumps(
        {"command": shlex.join([sys.executable, *sys.argv]), "checks": done}, indent=1))
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    return 0 if all(r["rc"] == 0 for r in done) else 1


if __name__ == "__main__":
    raise SystemExit(main())
