"""scripts/bench_common.files_tree: the id of the files measured, whatever ``.git`` says."""

from __future__ import annotations

import subprocess

from scripts.bench_common import files_tree


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_the_files_tree_is_the_commits_where_the_files_are_and_moves_with_them(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("carried/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    commit = _git(tmp_path, "rev-parse", "HEAD^{tree}")
    assert files_tree(tmp_path) == commit
    (tmp_path / "carried").mkdir()
    (tmp_path / "carried" / "w.whl").write_text("ignored")
    assert files_tree(tmp_path) == commit  # ignored paths are not the tree
    (tmp_path / "a.py").write_text("x = 2\n")
    changed = files_tree(tmp_path)
    assert changed not in (None, commit)
    assert _git(tmp_path, "diff", "--cached", "--name-only") == ""  # the index untouched
    _git(tmp_path, "commit", "-qam", "two")  # the files now a commit's: its tree
    assert changed == _git(tmp_path, "rev-parse", "HEAD^{tree}")
