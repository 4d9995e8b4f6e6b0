"""Which instruction set the CPU expert kernels use (tiles.py), chosen once per process.

``TANDEM_CPU_ISA`` = ``portable`` | ``avx2`` | ``avx512vnni`` | ``amx`` forces one (an error if
this CPU cannot run it); unset, the best one the host has is used. Every choice computes the
same bits. ``amx`` is ``avx512vnni`` whose 16-row int4 blocks go through AMX tiles (amx.py);
it needs the CPU's ``amx-tile`` and ``amx-int8`` and Linux's permission to use the tile state,
which :func:`available` requests for the process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``). It is
used only when named: on the H200 machine it is exact but slower than ``avx512vnni`` on 16
threads (one expert, 16 rows, gate/up: 121 us against 63; docs/cpu_experts.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

ISA_PORTABLE = 0
ISA_AVX2 = 1
ISA_AVX512VNNI = 2
ISA_AMX = 3

NAMES = {ISA_PORTABLE: "portable", ISA_AVX2: "avx2", ISA_AVX512VNNI: "avx512vnni",
         ISA_AMX: "amx"}
_NEEDS = {
    ISA_PORTABLE: (),
    ISA_AVX2: ("avx2", "ssse3"),
    ISA_AVX512VNNI: ("avx512f", "avx512bw", "avx512vnni"),
    ISA_AMX: ("avx512f", "avx512bw", "avx512vnni", "amx-tile", "amx-int8"),
}
ENV = "TANDEM_CPU_ISA"
SYS_ARCH_PRCTL = 158  # x86-64 Linux
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def host_features() -> set[str]:
    """CPU features LLVM (hence Numba) compiles for on this host."""
    import llvmlite.binding as llvm

    return {name for name, on in llvm.get_host_cpu_features().items() if on}


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: Linux grants the tile data state per process on
    request (once; later calls return the cached answer). False off x86-64 Linux."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def available() -> list[int]:
    """Instruction sets this CPU can run, worst first."""
    have = host_features()
    return [isa for isa, needs in _NEEDS.items() if all(f in have for f in needs)
            and (isa != ISA_AMX or amx_permitted())]


def select(name: str | None = None) -> int:
    """The instruction set to use: ``name`` (or ``$TANDEM_CPU_ISA``) if given, else the best."""
    name = name if name is not None else os.environ.get(ENV) or None
    can = available()
    if name is None:  # NOTE: amx only when asked for: slower than avx512vnni so far (amx.py)
        return max(isa for isa in can if isa != ISA_AMX)
    by_name = {v: k for k, v in NAMES.items()}
    if name not in by_name:
        raise ValueError(f"{ENV}={name!r}: expected one of {', '.join(by_name)}")
    if by_name[name] not in can:
        raise ValueError(f"{ENV}={name!r}: this CPU cannot run it (it can: "
                         f"{', '.join(NAMES[i] for i in can)})")
    return by_name[name]
