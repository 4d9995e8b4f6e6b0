"""Which instruction set the CPU expert kernels use (tiles.py), chosen once per process.

``TANDEM_CPU_ISA`` = ``portable`` | ``avx2`` | ``avx512vnni`` forces one (an error if this CPU
cannot run it); unset, the best one the host has is used. Every choice computes the same bits.
"""

from __future__ import annotations

import os

ISA_PORTABLE = 0
ISA_AVX2 = 1
ISA_AVX512VNNI = 2

NAMES = {ISA_PORTABLE: "portable", ISA_AVX2: "avx2", ISA_AVX512VNNI: "avx512vnni"}
_NEEDS = {
    ISA_PORTABLE: (),
    ISA_AVX2: ("avx2", "ssse3"),
    ISA_AVX512VNNI: ("avx512f", "avx512bw", "avx512vnni"),
}
ENV = "TANDEM_CPU_ISA"


def host_features() -> set[str]:
    """CPU features LLVM (hence Numba) compiles for on this host."""
    import llvmlite.binding as llvm

    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def available() -> list[int]:
    """Instruction sets this CPU can run, worst first."""
    have = host_features()
    return [isa for isa, needs in _NEEDS.items() if all(f in have for f in needs)]


def select(name: str | None = None) -> int:
    """The instruction set to use: ``name`` (or ``$TANDEM_CPU_ISA``) if given, else the best."""
    name = name if name is not None else os.environ.get(ENV) or None
    can = available()
    if name is None:
        return can[-1]
    by_name = {v: k for k, v in NAMES.items()}
    if name not in by_name:
        raise ValueError(f"{ENV}={name!r}: expected one of {', '.join(by_name)}")
    if by_name[name] not in can:
        raise ValueError(f"{ENV}={name!r}: this CPU cannot run it (it can: "
                         f"{', '.join(NAMES[i] for i in can)})")
    return by_name[name]
