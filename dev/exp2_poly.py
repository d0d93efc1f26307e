"""The polynomial of the Hopper forward's exp2 on the FP32 pipes (kernels/sm90/fwd_softmax.h:
exp2_fma): fits p(f) ~ 2^f on [0, 1] with p(0) = 1 exactly, minimising the maximum relative
error by linear programming on a fine grid, then checks exp2_fma's fp32 bit-level emulation
(the clamp at -127, the round-down add of 1.5 * 2^23, Horner's FMAs rounded to fp32, 2^j built
in the exponent field and multiplied in) against float64 2^x: its relative error over the
softmax's range of exponents, exact 0 for masked scores (-inf and everything <= -127), NaN
kept, exact powers of two at integers.  CPU only, NumPy and SciPy; not a test.

Usage: python dev/exp2_poly.py [--degree 3]
"""

import argparse

import numpy as np
from scipy.optimize import linprog


def fit(degree: int, points: int = 4001) -> tuple[np.ndarray, float]:
    """Coefficients c_0 = 1, c_1 .. c_degree of the minimax-relative-error polynomial, and its
    error on the grid."""
    f = np.linspace(0.0, 1.0, points)
    y = 2.0 ** f
    a = np.stack([f ** k / y for k in range(1, degree + 1)], 1)  # (p(f) - 1) / 2^f
    b = 1.0 / y - 1.0
    ones = np.ones((points, 1))
    # minimise e subject to -e <= a c + (1 / y - 1) <= e
    a_ub = np.vstack([np.hstack([a, -ones]), np.hstack([-a, -ones])])
    b_ub = np.concatenate([-b, b])
    res = linprog(np.r_[np.zeros(degree), 1.0], A_ub=a_ub, b_ub=b_ub,
                  bounds=[(None, None)] * (degree + 1))
    assert res.success, res.message
    return np.r_[1.0, res.x[:degree]], float(res.x[-1])


def fma32(a, b, c):
    """fp32 fused multiply-add: the product of two fp32 values is exact in float64 (48 bits),
    the sum rounded once more (a float64 rounding first: differs from one rounding only in
    rare ties, far below the errors measured here)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def exp2_fma(x: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """The kernel's exp2_fma, bit for bit up to fma32's note, on fp32 x."""
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127.0)))  # max.NaN.f32
        big = np.float32(12582912.0)  # 1.5 * 2^23
        # __fadd_rd: the largest fp32 not above xc + 1.5 * 2^23, which is 1.5 * 2^23 + floor(xc)
        # (fp32 is spaced 1 apart there; floor first: xc + 1.5 * 2^23 in float64 would round
        # up for |xc| < ~2^-29)
        t = (np.floor(xc.astype(np.float64)) + 12582912.0).astype(np.float32)
        t = np.where(np.isnan(xc), xc, t)
        f = (xc - (t - big)).astype(np.float32)
        c = coeffs.astype(np.float32)
        p = np.full_like(f, c[-1])
        for k in range(len(c) - 2, -1, -1):
            p = fma32(p, f, np.full_like(f, c[k]))
        tbits = t.view(np.uint32)
        two_j = ((np.uint32(0x3F800000) + (tbits << np.uint32(23))) & np.uint32(0xFFFFFFFF))
        return (p * two_j.view(np.float32)).astype(np.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--degree", type=int, default=3)
    args = parser.parse_args()
    coeffs, err = fit(args.degree)
    print(f"degree {args.degree}: minimax relative error {err:.3g} (2^{np.log2(err):.2f})")
    print("coefficients (fp32):", ", ".join(repr(float(np.float32(c))) for c in coeffs))
    # The online softmax's exponents: <= kRescaleLog2 = 8, down to where 2^x is fp32's
    # smallest normal (below, the kernel and MUFU's ex2.ftz give 0 or a denormal).
    x = np.linspace(-126.0, 8.0, 2_000_001).astype(np.float32)
    x = np.concatenate([x, np.float32(1.0) - np.logspace(-7, 0, 10001).astype(np.float32),
                        -np.logspace(-38, 0, 10001).astype(np.float32)])
    got = exp2_fma(x, coeffs).astype(np.float64)
    rel = np.abs(got / 2.0 ** x.astype(np.float64) - 1.0)
    print(f"exp2_fma on [-126, 8]: max relative error {rel.max():.3g} "
          f"(2^{np.log2(rel.max()):.2f})")
    edge = np.array([-np.inf, -1e30, -200.0, -127.5, -127.0, -126.5], dtype=np.float32)
    out = exp2_fma(edge, coeffs)
    assert (out == 0.0).all(), out  # (-126.5: j = -127, whose 2^j is 0)
    assert np.isnan(exp2_fma(np.array([np.nan], dtype=np.float32), coeffs)).all()
    ints = np.arange(-126, 9, dtype=np.float32)
    assert (exp2_fma(ints, coeffs) == 2.0 ** ints).all()
    print("exact 0 at -inf and x <= -127, NaN kept, exact powers of two at integers: ok")


if __name__ == "__main__":
    main()
