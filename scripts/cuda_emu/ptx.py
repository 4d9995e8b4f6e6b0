"""Inline PTX of the kernels as host C++: each ``asm("op %0, %1, ...;" : "=f"(d) : "f"(a) ...)``
statement with one instruction the emulator knows becomes ``d = emu_ptx_op(a, ...);``.

Known: ``add sub mul div fma sqrt`` with ``.rn`` on ``.f32`` / ``.f64`` (``.ftz`` flushes
subnormals; without it they are kept even when the launch models -ftz=true, as on the device),
``slct.f32.s32`` / ``slct.f64.s32`` (a select on the sign of an int) and
``mov.u64 %0, %%globaltimer``. Anything else stops the build with the statement quoted."""

from __future__ import annotations

import re

_ASM = re.compile(r"\basm\s*(?:volatile\s*|__volatile__\s*)?\(\s*\"((?:[^\"\\]|\\.)*)\"\s*:"
                  r"(.*?)\)\s*;", re.S)
_OPERAND = re.compile(r"\"[=+&]*\w\"\s*\(((?:[^()]|\([^()]*\))*)\)")
_ARITH = re.compile(r"(add|sub|mul|div|fma|sqrt)\.rn(\.ftz)?\.f(32|64)$")
_SLCT = re.compile(r"slct\.f(32|64)\.s32$")
_ARITY = {"add": 2, "sub": 2, "mul": 2, "div": 2, "fma": 3, "sqrt": 1}


class PtxError(ValueError):
    """An asm statement the emulator cannot translate."""


def _call(instr: str, ops: list[str], text: str) -> str:
    parts = instr.replace(",", " ").split()
    op, regs = parts[0], parts[1:]
    if op == "mov.u64" and regs[1:] == ["%%globaltimer"] and len(ops) == 1:
        return f"{ops[0]} = emu_ptx_globaltimer();"
    if _SLCT.match(op) and len(regs) == 4 and len(ops) == 4:  # d = c >= 0 ? a : b
        d, a, b, c = (ops[int(r.lstrip("%"))] for r in regs)
        return f"{d} = ({c}) >= 0 ? ({a}) : ({b});"
    m = _ARITH.match(op)
    if not m or len(regs) != _ARITY[m[1]] + 1 or len(ops) != len(regs):
        raise PtxError(f"the CUDA emulator does not know this inline PTX: {text.strip()}")
    try:
        order = [int(r.lstrip("%")) for r in regs]
    except ValueError:
        raise PtxError(f"inline PTX with other than %N operands: {text.strip()}") from None
    args = ", ".join(f"({ops[i]})" for i in order[1:])
    return f"{ops[order[0]]} = emu_ptx_{m[1]}{'_ftz' if m[2] else ''}({args});"


def translate_asm(code: str) -> str:
    """``code`` with every single-instruction asm statement replaced by a call (the statement's
    line count kept, so compiler messages and deadlock reports give the kernel's lines)."""

    def one(m: re.Match) -> str:
        instr = m[1].encode().decode("unicode_escape").strip().rstrip(";").strip()
        if ";" in instr:
            raise PtxError(f"inline PTX of several instructions: {m[0].strip()}")
        ops = [o.strip() for o in _OPERAND.findall(m[2])]
        return _call(instr, ops, m[0]) + "\n" * m[0].count("\n")

    return _ASM.sub(one, code)
