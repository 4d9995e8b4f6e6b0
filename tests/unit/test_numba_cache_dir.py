"""cpu_experts points Numba's cache at a folder named by a hash of its sources, so a change to
a micro-kernel module (which Numba's own cache check does not see) compiles afresh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import cpu_experts

PACKAGE = Path(cpu_experts.__file__).parent
SHOW = "import os, cpu_experts, numba; print(os.environ['NUMBA_CACHE_DIR'], numba.config.CACHE_DIR)"


def _dirs(cwd: Path, env: dict[str, str], code: str = SHOW) -> list[str]:
    env = {**os.environ, **env, "PYTHONPATH": str(cwd)}
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.split()


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(PACKAGE, root / "cpu_experts",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_numba_reads_the_hashed_folder(tmp_path):
    root = _copy(tmp_path)
    env_dir, config_dir = _dirs(root, {"NUMBA_CACHE_DIR": ""})
    assert env_dir == config_dir
    assert Path(env_dir).parent == root / "cpu_experts" / "__pycache__"
    assert Path(env_dir).name.startswith(cpu_experts.PREFIX)
    # numba imported first: its config is made to read the variable again
    first = "import numba, cpu_experts; print(numba.config.CACHE_DIR)"
    assert _dirs(root, {"NUMBA_CACHE_DIR": ""}, first) == [env_dir]


def test_a_source_change_moves_the_folder(tmp_path):
    root = _copy(tmp_path)
    before = _dirs(root, {"NUMBA_CACHE_DIR": ""})[0]
    tiles = root / "cpu_experts" / "tiles.py"
    tiles.write_text(tiles.read_text() + "\n# changed\n")
    after = _dirs(root, {"NUMBA_CACHE_DIR": ""})[0]
    assert after != before and Path(after).parent == Path(before).parent


def test_a_users_folder_is_the_parent_once(tmp_path):
    root = _copy(tmp_path)
    user = tmp_path / "numba-cache"
    mine = _dirs(root, {"NUMBA_CACHE_DIR": str(user)})[0]
    assert Path(mine).parent == user
    # a worker process inherits the hashed folder and keeps it (no folder inside it)
    assert _dirs(root, {"NUMBA_CACHE_DIR": mine}) == [mine, mine]
