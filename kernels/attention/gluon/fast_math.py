"""exp2 for the Gluon softmax: on the MUFU unit, or partly emulated on the FMA pipe (FlashAttention-4's split).

`exp2_mixed(x, EXP2_EMULATED)` (a `@gluon.jit` helper) computes exp2 of fp32 scores x <= 0: all by `gl.exp2` with
EXP2_EMULATED 0, else one in EXP2_EMULATED (2, 4, 8 or 16) by a degree-3 polynomial (`EXP2_POLY`) and an exponent-bit
add, as inline PTX (`exp2_mixed_asm`). The emulated values are within 7.5e-5 of 2^x relative, below every 16-bit
output's resolution.
"""

from __future__ import annotations

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import gl, gluon

EXP2_POLY = (0x3F7FFB49, 0x3F31798D, 0x3E786F0E, 0x3D61FBB0)
"""fp32 bits of c0..c3, 2^f ~ c0 + f (c1 + f (c2 + f c3)) on f in [-1/2, 1/2]: a least-squares fit of the relative
error refined toward minimax (Lawson), at most 7.5e-5 of 2^f in fp32, against bf16's 2^-9 and fp16's 2^-11 steps."""


def exp2_mixed_asm(every: int) -> str:
    """PTX for `every` consecutive fp32 scores x <= 0 (inline asm, `pack=every`): exp2 of the first every - 1 on the
    MUFU unit (`ex2.approx`), of the last by FlashAttention-4's emulation on the FMA and integer pipes: x clamped to
    -126, split as n + f with n = round(x) (the 1.5 * 2^23 shifter, no conversion instruction), 2^f by `EXP2_POLY`,
    and 2^n added to the result's exponent bits (n << 23; exact, as the result stays normal). A masked score (-inf)
    comes out about 2^-126 instead of 0: below every 16-bit output's resolution next to the row's exp2(0) = 1."""
    if every < 2:
        raise ValueError(f"every ({every}) must be >= 2")
    c0, c1, c2, c3 = (f"0f{c:08X}" for c in EXP2_POLY)
    native = "".join(f"ex2.approx.ftz.f32 ${i}, ${i + every};\n" for i in range(every - 1))
    out, arg = f"${every - 1}", f"${2 * every - 1}"
    return ("{\n.reg .b32 t, j, n, f, p, e;\n" + native
            + f"max.ftz.f32 t, {arg}, 0fC2FC0000;\n"       # -126
            + "add.rn.f32 j, t, 0f4B400000;\n"              # 1.5 * 2^23 + round(t) in the low bits
            + "sub.rn.f32 n, j, 0f4B400000;\n"
            + "sub.rn.f32 f, t, n;\n"
            + f"fma.rn.f32 p, f, {c3}, {c2};\n"
            + f"fma.rn.f32 p, p, f, {c1};\n"
            + f"fma.rn.f32 p, p, f, {c0};\n"
            + "shl.b32 e, j, 23;\n"
            + f"add.s32 {out}, p, e;\n}}")



if HAS_GLUON_HOPPER:
    _EXP2_ASM_2: gl.constexpr = gl.constexpr(exp2_mixed_asm(2))
    _EXP2_ASM_4: gl.constexpr = gl.constexpr(exp2_mixed_asm(4))
    _EXP2_ASM_8: gl.constexpr = gl.constexpr(exp2_mixed_asm(8))
    _EXP2_ASM_16: gl.constexpr = gl.constexpr(exp2_mixed_asm(16))
    _EXP2_REGS_2: gl.constexpr = gl.constexpr(",".join(["=r"] * 2 + ["r"] * 2))
    _EXP2_REGS_4: gl.constexpr = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 4))
    _EXP2_REGS_8: gl.constexpr = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))
    _EXP2_REGS_16: gl.constexpr = gl.constexpr(",".join(["=r"] * 16 + ["r"] * 16))

    @gluon.jit
    def exp2_mixed(x, EXP2_EMULATED: gl.constexpr):
        """exp2(x) for x <= 0: all on the MUFU unit (EXP2_EMULATED 0), or one in EXP2_EMULATED (2, 4, 8 or 16) of
        them emulated on the FMA pipe (`exp2_mixed_asm`)."""
        if EXP2_EMULATED == 0:
            return gl.exp2(x)
        elif EXP2_EMULATED == 2:
            return gl.inline_asm_elementwise(_EXP2_ASM_2, _EXP2_REGS_2, [x], dtype=gl.float32, is_pure=True, pack=2)
        elif EXP2_EMULATED == 4:
            return gl.inline_asm_elementwise(_EXP2_ASM_4, _EXP2_REGS_4, [x], dtype=gl.float32, is_pure=True, pack=4)
        elif EXP2_EMULATED == 8:
            return gl.inline_asm_elementwise(_EXP2_ASM_8, _EXP2_REGS_8, [x], dtype=gl.float32, is_pure=True, pack=8)
        else:
            gl.static_assert(EXP2_EMULATED == 16, "EXP2_EMULATED must be 0, 2, 4, 8 or 16")
            return gl.inline_asm_elementwise(_EXP2_ASM_16, _EXP2_REGS_16, [x], dtype=gl.float32, is_pure=True,
                                             pack=16)
