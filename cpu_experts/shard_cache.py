"""CPU-expert shards kept between runs (``[experts] shard_cache``, docs/cpu_experts.md).

Quantizing and tiling the CPU experts is most of a large model's load (70 GiB of int8 shards
for the 80B at a 32 GiB GPU budget: about a minute on 16 cores). With a cache directory the
shards are files there, named by a key of everything their bytes depend on (the weights'
source, the placement's CPU expert ids per layer, the format, the workers' split, the code
that lays out the tiles); a later load with the same key maps them instead of writing them,
and a worker restart or a new server is ready that much sooner.

An entry is ``<dir>/<key>/``: ``experts<w>.bin`` per worker, ``complete`` (written last, with
the shard sizes: an entry without it is a load that did not finish, and is rebuilt), and two
lock files. ``build.lock`` is held exclusively while an entry is checked or filled (a second
server with the same key waits for the first to finish, then maps its shards); ``use.lock``
is held shared by every process that uses the entry, for as long as it does. Making a new
entry removes every other entry that no process uses, so the directory holds one model's
shards unless two servers run at once. Put the directory on a memory file system
(``/dev/shm/...``): the workers map the files, and a disk file would be read at start-up.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

# the modules whose code decides a shard's bytes (tiles, quantizers, formats): any change to
# them gives new keys, so a cache never serves tiles an older layout wrote
LAYOUT_MODULES = ("shard.py", "quant.py", "quant_vec.py", "quant4.py", "formats.py", "tiles.py",
                  "tiles4.py")


def code_hash(*files: str | Path) -> str:
    """A digest of these source files' names and bytes (a cache key's "the code")."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode() + b"\0" + Path(f).read_bytes())
    return h.hexdigest()


def layout_hash() -> str:
    here = Path(__file__).resolve().parent
    return code_hash(*(here / name for name in LAYOUT_MODULES))


def cache_key(facts: dict) -> str:
    """The entry name of shards whose bytes follow from ``facts`` (JSON-able) and the tile
    layout's code."""
    text = json.dumps({"facts": facts, "layout": layout_hash()}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CacheEntry:
    """One key's directory, locked for use (and for building until :meth:`built`).
    ``complete``: the shards are there, made by an earlier load; else the caller writes
    ``path(w)`` for every worker (the stale ones are gone) and then calls :meth:`built`."""

    def __init__(self, root: str | Path, key: str, sizes: list[int]) -> None:
        self.root, self.dir, self.sizes = Path(root), Path(root) / key, list(sizes)
        self._use = self._build = None
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.dir.mkdir(exist_ok=True, mode=0o700)
            self._use = _lock(self.dir / "use.lock", fcntl.LOCK_SH)
            self._build = _lock(self.dir / "build.lock", fcntl.LOCK_EX)
        except OSError as exc:
            self.close()
            raise OSError(f"experts.shard_cache {root}: cannot use it ({exc})") from None
        try:
            self.complete = self._is_complete()
            if self.complete:
                self._unlock_build()
            else:
                evict(self.root, keep=key)
                for f in self.dir.glob("experts*.bin"):
                    f.unlink()
                (self.dir / "complete").unlink(missing_ok=True)
        except BaseException:
            self.close()
            raise

    def path(self, w: int) -> str:
        return str(self.dir / f"experts{w}.bin")

    def _is_complete(self) -> bool:
        try:
            marker = json.loads((self.dir / "complete").read_text())
        except (OSError, ValueError):
            return False
        if marker.get("sizes") != self.sizes:
            return False
        for w, size in enumerate(self.sizes):
            try:
                if os.path.getsize(self.path(w)) != max(size, 1):
                    return False
            except OSError:
                return False
        return True

    def built(self) -> None:
        """Every shard written: mark the entry complete and let other loads map it."""
        tmp = self.dir / "complete.tmp"
        tmp.write_text(json.dumps({"sizes": self.sizes}))
        os.replace(tmp, self.dir / "complete")
        self.complete = True
        self._unlock_build()

    def _unlock_build(self) -> None:
        if self._build is not None:
            os.close(self._build)
            self._build = None

    def close(self) -> None:
        """Stop using the entry (its files stay for the next load)."""
        self._unlock_build()
        if self._use is not None:
            os.close(self._use)
            self._use = None


def _lock(path: Path, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reclaimable_bytes(root: str | Path | None) -> int:
    """Host memory a new load may count as free although MemAvailable does not: the shard
    files of the entries no process uses, where ``root`` is on a memory file system (a load
    maps such an entry or removes it before it writes its own). 0 elsewhere."""
    if not root or not Path(root).is_dir() or not _in_memory(Path(root)):
        return 0
    return sum(f.stat().st_blocks * 512 for entry in _idle_entries(root)
               for f in entry.glob("experts*.bin"))


def _idle_entries(root: str | Path, skip: str = "") -> Iterator[Path]:
    """The entries of ``root`` (but ``skip``) that no process uses, each yielded while this
    process holds its use lock exclusively."""
    for entry in sorted(Path(root).iterdir()):
        lock = entry / "use.lock"
        if entry.name == skip or not entry.is_dir() or not lock.exists():
            continue
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a running server maps it
        try:
            yield entry
        finally:
            os.close(fd)


def _in_memory(path: Path) -> bool:
    """Whether ``path`` is on tmpfs or ramfs (its pages are host memory)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                target = str(path.resolve())
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return False
    return kind in ("tmpfs", "ramfs")


def evict(root: str | Path, keep: str) -> list[str]:
    """Remove every entry of ``root`` but ``keep`` that no process uses; their names."""
    gone = []
    for entry in _idle_entries(root, skip=keep):
        shutil.rmtree(entry, ignore_errors=True)
        gone.append(entry.name)
    return gone
