"""fp32 emulation of the Hopper forward's online softmax (kernels/sm90/fwd_softmax.h) on one
row, against a float64 reference, as |max score * softmax_scale * log2 e| (M) grows: where the
one-FFMA exponent exp2(fma(s, c, -round(m c))) loses accuracy and where it overflows (issue
29, huge scores).  CPU only, NumPy; not a test.

Bookkeeping variants:
  today       the kernel's: O's rescale factor exp2(fma(m_old, c, -round(m_new c))) and the
              LSE from fma(m, c, log2 l): both use the exact m c, while P used the rounded one,
              so O and l disagree by 2^(rounding of m c) at each raise of the max.
  consistent  the rescale factor exp2(round(m_old c) - round(m_new c)) and the LSE from
              round(m c) + log2 l: the same rounded reference everywhere (same instruction
              count).
  consistent+RU  with round(m c) rounded up (P <= 1 before the lazy rescale's margin).
P goes through fp16 before P V (the fp16 kernels; bf16 has fp32's range).

Usage: python dev/huge_scores_emulation.py
"""

import numpy as np

f32, f16 = np.float32, np.float16


def fma(a, b, c):
    # (a float64 product of two float32 is exact; one rounding to float32 after the sum)
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def ex2(x):
    return f32(np.exp2(np.float64(x))) if x > -150 else f32(0)


def online_row(s, v, c, mode, round_up=False, tile=128, lazy=8.0):
    """out of one row: scores s (n,), values v (n, d), c = softmax_scale * log2 e."""
    m, row_sum, mh = -np.inf, f32(0), f32(0)
    o = np.zeros(v.shape[1], np.float32)
    for t in range(0, len(s), tile):
        st, vt = s[t:t + tile], v[t:t + tile]
        mx = st.max()
        moves = m == -np.inf or f32((mx - m) * c) > lazy  # lazy rescaling, as the kernel
        m_new = mx if moves else m
        mh_new = f32(m_new * c)
        if round_up and np.float64(mh_new) < np.float64(m_new) * np.float64(c):
            mh_new = np.nextafter(mh_new, f32(np.inf))
        if m == -np.inf:
            alpha = f32(0)
        elif not moves:
            alpha = f32(1)
        else:
            alpha = ex2(fma(m, c, -mh_new)) if mode == "today" else ex2(f32(mh - mh_new))
        p = np.array([ex2(fma(x, c, -mh_new)) for x in st], np.float32)
        row_sum = f32(row_sum * alpha + p.sum(dtype=np.float32))
        o = (o * alpha + p.astype(f16).astype(np.float32) @ vt).astype(np.float32)
        m, mh = m_new, mh_new
    return o / row_sum


def exact_row(s, v, c):
    x = s.astype(np.float64) * c
    w = np.exp2(x - x.max())
    return (w / w.sum()) @ v.astype(np.float64)


def main() -> int:
    rng = np.random.default_rng(1)
    n, d = 512, 8
    v = rng.random((n, d)).astype(np.float32)
    variants = {"today": ("today", False), "consistent": ("consistent", False),
                "consistent+RU": ("consistent", True)}
    print("log2 M  " + "  ".join(f"{k:>14s}" for k in variants) + "   (max |out error|, 20 rows)")
    for e in (16, 20, 24, 26, 27, 28, 30, 31, 32, 33):
        worst = dict.fromkeys(variants, 0.0)
        for _ in range(20):
            c = f32(1.4426950408889634 * rng.uniform(0.05, 100))
            s = (2.0 ** e / c * (1 + rng.standard_normal(n) * 1e-6)).astype(np.float32)
            ref = exact_row(s, v, c)
            with np.errstate(all="ignore"):
                for k, (mode, up) in variants.items():
                    o = online_row(s, v, c, mode, up)
                    err = np.abs(o - ref).max() if np.isfinite(o).all() else np.inf
                    worst[k] = max(worst[k], err)
        print(f"{e:6d}  " + "  ".join(f"{worst[k]:14.2e}" for k in variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
