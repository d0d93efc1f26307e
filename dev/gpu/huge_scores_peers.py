"""Issue 29's inputs through PyTorch's SDPA backends and ours: non-finite outputs and errors.

q, k uniform in [-900, 0], v in [0, 1], shape (2, 8, 128, 64) (B, H, L, d), fp16 and bf16, at
softmax scales 1, 10, 100 and 1000 (scores of magnitude up to ~5e8).  For each backend that
takes the call: how many elements of out (and of dq, dk, dv) are not finite, and the largest
error of the finite ones against a float64 reference of softmax(q kᵀ · scale) v and its
gradients (for dO uniform in [0, 1]), beside the reference's largest magnitude (the softmax is
one-hot at these scores, so the true dq and dk are ~0 and their error is the rounding of
dS = P (dP - D), multiplied by the scale).  Ours runs
where the extension is built (`flash_attn_ext.scaled_dot_product_attention`).

Usage on the GPU machine: python3 dev/gpu/huge_scores_peers.py
"""
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as torch_sdpa


def backends():
    out = {name: functools.partial(_under, be)
           for name, be in (("MATH", SDPBackend.MATH), ("FLASH", SDPBackend.FLASH_ATTENTION),
                            ("EFFICIENT", SDPBackend.EFFICIENT_ATTENTION),
                            ("CUDNN", SDPBackend.CUDNN_ATTENTION))}
    try:
        import flash_attn_ext
        out["ours"] = lambda q, k, v, s: flash_attn_ext.scaled_dot_product_attention(q, k, v,
                                                                                      scale=s)
    except ImportError as e:  # (not built on this machine)
        print(f"ours: not importable ({e})")
    return out


def _under(backend, q, k, v, scale):
    with sdpa_kernel([backend]):
        return torch_sdpa(q, k, v, scale=scale)


def report(name, got, true):
    bad = int((~torch.isfinite(got)).sum())
    finite = torch.isfinite(got)
    err = ((got.double() - true).abs()[finite].max().item() if finite.any() else float("nan"))
    return f"{name} {bad:6d} non-finite, err {err:.1e} (|true| <= {true.abs().max().item():.1e})"


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 128, 64)
    for dtype in (torch.float16, torch.bfloat16):
        q, k = ((torch.rand(shape, device="cuda", generator=gen) * -900).to(dtype) for _ in "qk")
        v = torch.rand(shape, device="cuda", generator=gen).to(dtype)
        dout = torch.rand(shape, device="cuda", generator=gen).to(dtype)
        for scale in (1.0, 10.0, 100.0, 1000.0):
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            true = torch.softmax(ref[0] @ ref[1].transpose(-1, -2) * scale, -1) @ ref[2]
            true_grads = torch.autograd.grad(true, ref, dout.double())
            for name, fn in backends().items():
                args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                try:
                    out = fn(*args, scale)
                    grads = torch.autograd.grad(out, args, dout)
                except RuntimeError as e:  # (a backend that does not take the call)
                    print(f"{str(dtype)[6:]:8s} scale {scale:6g} {name:9s} refused: "
                          f"{str(e).splitlines()[0][:80]}")
                    continue
                parts = [report("out", out, true.detach())]
                parts += [report(g, got, t) for g, got, t in zip(("dq", "dk", "dv"), grads,
                                                                  true_grads)]
                print(f"{str(dtype)[6:]:8s} scale {scale:6g} {name:9s} " + "; ".join(parts))


if __name__ == "__main__":
    main()
