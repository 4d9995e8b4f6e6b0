"""scripts/device_check.py: per-check timeouts, the budget, one tar of logs plus a summary."""

from __future__ import annotations

import json
import subprocess
import tarfile

import pytest

from scripts import device_check
from scripts.device_check import Check
from scripts.device_plans import H200_ONLY, MATRIX_TIMES, matrix


def test_checks_run_time_out_and_skip_within_the_budget(tmp_path, monkeypatch):
    monkeypatch.setitem(device_check.PLANS, "t", [
        Check("ok", "echo $CHECK_SECONDS > $OUT/made.txt; echo hello", 10),
        Check("fails", "echo broken; exit 3", 10),
        Check("hangs", "sleep 30", 1),
        Check("late", "echo never", 60),
    ])
    rc = device_check.main(["--out", str(tmp_path), "--plan", "t", "--budget", "20"])
    assert rc == 1
    got = {r["name"]: r for r in json.loads((tmp_path / "summary.json").read_text())["checks"]}
    assert got["ok"]["rc"] == 0 and got["ok"]["last_line"] == "hello"
    # $OUT is the output folder; CHECK_SECONDS the check's own time (its timeout here)
    assert (tmp_path / "made.txt").read_text().strip() == "10"
    assert got["fails"]["rc"] == 3 and got["fails"]["last_line"] == "broken"
    assert got["hangs"]["rc"] == "timeout" and got["hangs"]["seconds"] < 10
    assert got["late"]["rc"] == "skipped"  # under 30 s left of 20: not started
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs", "logs/fails.log", "logs/hangs.log",
                                          "logs/ok.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "made.txt",
                                                          "summary.json"]


def test_every_plan_lists():
    assert device_check.main(["--list"]) == 0


def test_every_plan_names_files_and_options_that_exist():
    """A lent machine's minutes are few: a plan that names a test file or script that is
    gone, or an option a script no longer takes, would waste a call. Every ``tests/...py``
    path, every ``python3 -m scripts.X`` module and each of its ``--options`` must exist."""
    import importlib
    import re
    from pathlib import Path

    from scripts.device_plans import PLANS

    root = Path(__file__).resolve().parents[2]
    names: dict[str, list[str]] = {}
    for plan, checks in PLANS.items():
        names[plan] = [c.name for c in checks]
        assert len(set(names[plan])) == len(checks), plan  # one log per check
        for check in checks:
            for path in re.findall(r"tests/[\w/]+\.py", check.command):
                assert (root / path).is_file(), (plan, check.name, path)
            for call in re.findall(r"python3 -m (scripts\.\w+)([^;&|]*)", check.command):
                module, rest = call
                source = (root / (module.replace(".", "/") + ".py")).read_text()
                importlib.import_module(module)
                for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                    assert f'"{option}"' in source, (plan, check.name, module, option)


@pytest.mark.parametrize("card, any_gpu, rc, sfx", [
    ("NVIDIA H200", "", 0, ""), ("NVIDIA H100 80GB HBM3", "", 3, None),
    ("NVIDIA H100 80GB HBM3", "1", 0, "-other"), ("NVIDIA H200", "1", 0, "")])
def test_the_matrix_refuses_other_cards_or_keeps_their_runs_apart(tmp_path, card, any_gpu,
                                                                   rc, sfx):
    """An H100's matrix runs must never land among the H200's (they resume across calls)."""
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho '{card}'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "MATRIX_ANY_GPU": any_gpu}
    out = subprocess.run(["bash", "-c", H200_ONLY + "echo \"sfx=$sfx\""], env=env,
                         capture_output=True, text=True)
    assert out.returncode == rc
    if sfx is None:
        assert "not an H200" in out.stdout and "sfx=" not in out.stdout
    else:
        assert out.stdout.strip() == f"sfx={sfx}"


@pytest.mark.parametrize("env, lim, bud", [
    ({}, 540, 510), ({"CHECK_SECONDS": "290"}, 235, 205),
    ({"CHECK_SECONDS": "290", "MATRIX_BUDGET": "150", "MATRIX_LIMIT": "185"}, 185, 150)])
def test_the_matrix_fits_its_run_to_the_checks_time(env, lim, bud):
    """Session 40: --budget 290 killed the matrix check mid-run (its run's limit stayed 540 s)
    and no tar of its finished runs came back. The run's limit and budget now follow the
    check's seconds, which device_check passes as CHECK_SECONDS (the first test)."""
    out = subprocess.run(["bash", "-c", MATRIX_TIMES + 'echo "$lim $bud"'],
                         env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True)
    assert out.stdout.split() == [str(lim), str(bud)]
    command = matrix("32").command
    assert "timeout -k 15 $lim " in command and "--time-budget $bud " in command
    assert command.index(MATRIX_TIMES) < command.index("timeout -k 15 $lim")
