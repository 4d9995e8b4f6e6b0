"""The run directory (sockets, lock file) is trusted only when it is safe.

The default `/tmp/tandem-<uid>` (used without XDG_RUNTIME_DIR) lives in a directory every
local user can write to: another user could create it first and put their own socket in it,
or plant a symlink where the lock file goes. So the run directory must be a real directory
(not a symlink), owned by this user, with no access for group or others (mode 0700); it is
created so when absent, and refused otherwise. The lock file is opened without following
symlinks and never truncated. A client (protocol/client.py) checks the directory it is
given the same way before it connects (:func:`check_client_run_dir`), so it never talks to a
socket someone else planted.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class RunDirError(RuntimeError):
    """The run directory is not safe to use; the message says why and what to do."""


def secure_run_dir(path: str | os.PathLike) -> Path:
    """Create `path` (mode 0700) if absent; raise RunDirError unless it is a directory of
    this user's, not a symlink, that no one else may use."""
    run_dir = Path(path)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(run_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RunDirError(f"cannot create the run directory {run_dir}: {exc.strerror}") from None
    try:
        st = os.lstat(run_dir)
    except OSError as exc:
        raise RunDirError(f"cannot inspect the run directory {run_dir}: {exc.strerror}") \
            from None
    fix = "remove it or set [server] run_dir to a directory of your own"
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"the run directory {run_dir} is a symbolic link; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"the run directory {run_dir} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise RunDirError(f"the run directory {run_dir} belongs to uid {st.st_uid}, not to "
                          f"this user (uid {os.getuid()}); {fix}")
    if st.st_mode & 0o077:
        raise RunDirError(f"the run directory {run_dir} has mode "
                          f"{stat.S_IMODE(st.st_mode):04o}: others may use it; run "
                          f"'chmod 700 {run_dir}' or {fix}")
    return run_dir


def open_lock(path: str | os.PathLike) -> int:
    """The lock file's descriptor: created 0600 if absent, never through a symlink, never
    truncated. RunDirError when it is a symlink or not a regular file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RunDirError(f"the lock file {path} is a symbolic link; remove it") from None
        raise RunDirError(f"cannot open the lock file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirError(f"the lock file {path} is not a regular file; remove it")
    return fd


def check_client_run_dir(path: str | os.PathLike) -> Path:
    """A client's check of the daemon's run directory before it connects: a real directory
    (not a symlink) owned by this user or by root, that no one else may write to. Raises
    RunDirError saying what is wrong."""
    run_dir = Path(path)
    try:
        st = os.lstat(run_dir)
    except OSError as exc:
        raise RunDirError(f"no daemon run directory at {run_dir}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"the run directory {run_dir} is not a real directory (a symbolic "
                          "link or a file): refusing to connect")
    if st.st_uid not in (os.getuid(), 0):
        raise RunDirError(f"the run directory {run_dir} belongs to uid {st.st_uid}, not to "
                          f"this user (uid {os.getuid()}) or root: refusing to connect")
    if st.st_mode & 0o022:
        raise RunDirError(f"the run directory {run_dir} has mode {stat.S_IMODE(st.st_mode):04o}:"
                          " others may write to it, refusing to connect")
    return run_dir
