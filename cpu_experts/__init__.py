"""CPU experts: quantized MoE experts in host RAM, run by Numba kernels in worker processes.

Numba's on-disk cache (``cache=True``) checks only the source file of each cached function,
so kernels.py's compiled layer would outlive a change to the micro-kernels it inlines
(tiles.py, tiles4.py, irhelp.py...). Importing this package therefore points Numba's cache
(``NUMBA_CACHE_DIR``, inherited by the worker processes) at a folder named by a hash of the
package's sources, so any change here compiles afresh. A ``NUMBA_CACHE_DIR`` set by the user
becomes the parent of that folder; without one it is the package's ``__pycache__``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cpu_experts.shard_cache import code_hash

PREFIX = "tandem-numba-"


def cache_dir() -> str:
    """The Numba cache folder of this version of the package's sources."""
    here = Path(__file__).parent
    base = Path(os.environ.get("NUMBA_CACHE_DIR") or here / "__pycache__")
    if base.name.startswith(PREFIX):  # set by this package in a parent process
        base = base.parent
    return str(base / f"{PREFIX}{code_hash(*sorted(here.glob('*.py')))[:16]}")


os.environ["NUMBA_CACHE_DIR"] = cache_dir()
if "numba" in sys.modules:  # imported before us: make its config read the variable again
    sys.modules["numba"].config.reload_config()
