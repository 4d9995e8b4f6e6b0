"""The run directory is trusted only when safe (issue 16, defect 4): owned by this user, mode
0700, not a symlink; the lock file is never opened through a symlink nor truncated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from protocol.client import TandemClient
from protocol.run_dir import RunDirError, open_lock, secure_run_dir


def test_an_absent_run_dir_is_created_private(tmp_path):
    run = secure_run_dir(tmp_path / "a" / "run")
    assert run.is_dir() and (run.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_run_dir_others_may_use_is_refused(tmp_path, mode):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)
    with pytest.raises(RunDirError, match="chmod 700"):
        secure_run_dir(run)


def test_a_symlinked_run_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(RunDirError, match="symbolic link"):
        secure_run_dir(tmp_path / "run")


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        secure_run_dir(tmp_path / "run")


def test_the_lock_file_is_never_followed_nor_truncated(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "daemon.lock").symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link"):
        open_lock(tmp_path / "daemon.lock")
    assert victim.read_text() == "precious"
    (tmp_path / "daemon.lock").unlink()
    (tmp_path / "daemon.lock").write_text("old")
    os.close(open_lock(tmp_path / "daemon.lock"))
    assert (tmp_path / "daemon.lock").read_text() == "old"


def test_serve_refuses_an_unsafe_run_dir_with_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    config = tmp_path / "t.toml"
    config.write_text(f'[server]\nrun_dir = "{run}"\nport = 1\n')
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("tandem: error: the run directory")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_client_refuses_a_run_dir_someone_else_could_have_planted(tmp_path):
    """The client library checks the run directory before it connects: a socket in a
    directory another user made (or could write to) is never used."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(RunDirError, match="not a real directory"):
        TandemClient(run_dir=tmp_path / "link")
    real.chmod(0o777)
    with pytest.raises(RunDirError, match="others may write"):
        TandemClient(run_dir=real)
    real.chmod(0o700)
    if os.getuid() == 0:  # root can hand the directory to another user
        os.chown(real, 65534, 65534)
        with pytest.raises(RunDirError, match="belongs to uid 65534"):
            TandemClient(run_dir=real)
        os.chown(real, 0, 0)
    with pytest.raises(RunDirError, match="no daemon run directory"):
        TandemClient(run_dir=tmp_path / "absent")
    TandemClient(run_dir=real).close()  # a private directory of this user's is fine
