#!/usr/bin/env python3
"""Writes the kernel instantiation files: one translation unit per (kernel, head dim, dtype).

    python csrc/generate_kernels.py          # (re)write them
    python csrc/generate_kernels.py --check  # exit 1 naming the stale ones, write nothing

The files, under csrc/kernels/:
  sm80/flash_fwd_hdim{64,128,256}_{fp16,bf16}.cu          portable forward (sm80::run_flash_fwd)
  sm80/flash_bwd_hdim{64,128,256}_{fp16,bf16}.cu          portable backward (sm80::run_flash_bwd)
  sm80/flash_decode_hdim{64,128,256}_{fp16,bf16}.cu       split-KV decode against a KV cache
                                                          (sm80::run_flash_decode; the 64 files
                                                          also sm80::run_kvcache_append)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}.cu     Hopper forward (run_flash_fwd_sm90)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_packgqa.cu   ... with packed GQA heads
                                                          (run_flash_fwd_sm90_packgqa)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_general.cu   ... with softcap, bias,
                                                          ALiBi and dropout
                                                          (run_flash_fwd_sm90_general)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_dropout.cu   ... with dropout alone
                                                          (run_flash_fwd_sm90_dropout)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_mask.cu      ... with a boolean mask
                                                          alone (run_flash_fwd_sm90_mask)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen.cu    ... on packed sequences
                                                          (run_flash_fwd_sm90_varlen)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_softcap.cu   ... with softcap alone
                                                          (run_flash_fwd_sm90_softcap)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_alibi.cu     ... with ALiBi alone
                                                          (run_flash_fwd_sm90_alibi)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_softcap.cu  ... on packed
                                                          sequences with softcap alone
                                                          (run_flash_fwd_sm90_varlen_softcap)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_alibi.cu  ... on packed
                                                          sequences with ALiBi alone
                                                          (run_flash_fwd_sm90_varlen_alibi)
  sm90/flash_fwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_dropout.cu  ... on packed
                                                          sequences with dropout alone
                                                          (run_flash_fwd_sm90_varlen_dropout)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}.cu     Hopper backward (run_flash_bwd_sm90)
  sm90/flash_bwd_sm90_hdim{64,128}_{fp16,bf16}_general.cu ... with softcap, bias, ALiBi
                                                          and dropout (run_flash_bwd_sm90_general)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_dropout.cu ... with dropout alone
                                                          (run_flash_bwd_sm90_dropout)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_mask.cu ... with a boolean mask alone
                                                          (run_flash_bwd_sm90_mask)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen.cu ... on packed sequences
                                                          (run_flash_bwd_sm90_varlen)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_softcap.cu ... with softcap alone
                                                          (run_flash_bwd_sm90_softcap)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_alibi.cu ... with ALiBi alone
                                                          (run_flash_bwd_sm90_alibi)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_softcap.cu ... on packed
                                                          sequences with softcap alone
                                                          (run_flash_bwd_sm90_varlen_softcap)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_alibi.cu ... on packed
                                                          sequences with ALiBi alone
                                                          (run_flash_bwd_sm90_varlen_alibi)
  sm90/flash_bwd_sm90_hdim{64,128,256}_{fp16,bf16}_varlen_dropout.cu ... on packed
                                                          sequences with dropout alone
                                                          (run_flash_bwd_sm90_varlen_dropout)
Each specialises the launcher template its kernel's headers declare; setup.py and
scripts/check_cuda_compile.sh pick them up by globbing the folders.  Pure Python, no
dependencies (tests/test_generated_kernels.py runs --check in CPU CI).
"""

import argparse
import os
import sys

KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")

HEAD_DIMS = (64, 128, 256)
DTYPES = (("fp16", "__half"), ("bf16", "__nv_bfloat16"))

GENERATED = "// Generated by csrc/generate_kernels.py: edit the script, not this file.\n"

SM80_FWD = """\
// Forward instantiation: head dim {d}, {dtype}.
#include "kernels/sm80/flash_fwd_kernel.cuh"
#include "kernels/sm80/flash_fwd_launch.h"

namespace flash_attn_ext::sm80 {{

template <>
cudaError_t run_flash_fwd<{element}, {d}>(const FwdParams& p, cudaStream_t stream) {{
  using Traits = FwdTraits<{element}, {d}, fwd_block_n<{d}>(), fwd_m_tiles<{d}>()>;
  return launch_flash_fwd<Traits>(p, stream);
}}

}}  // namespace flash_attn_ext::sm80
"""

SM80_BWD = """\
// Backward instantiation: head dim {d}, {dtype}.
#include "kernels/sm80/flash_bwd_kernel.cuh"
#include "kernels/sm80/flash_bwd_launch.h"

namespace flash_attn_ext::sm80 {{

template <>
cudaError_t run_flash_bwd<{element}, {d}>(const BwdParams& p, float* delta, \
cudaStream_t stream) {{
  using Traits = BwdTraits<{element}, {d}, bwd_block_m<{d}>(), bwd_split_d<{d}>(), \
bwd_block_n_dq<{d}>()>;
  return launch_flash_bwd<Traits>(p, delta, stream);
}}

}}  // namespace flash_attn_ext::sm80
"""

SM80_DECODE = """\
// Decode instantiation: head dim {d}, {dtype}.
#include "kernels/sm80/flash_decode_kernel.cuh"
#include "kernels/sm80/flash_decode_launch.h"

namespace flash_attn_ext::sm80 {{

template <>
cudaError_t run_flash_decode<{element}, {d}>(const DecodeParams& p, cudaStream_t stream) {{
  return launch_flash_decode<{element}, {d}>(p, stream);
}}

template <>
int run_flash_decode_ctas_per_sm<{element}, {d}>(const DecodeParams& p) {{
  return flash_decode_ctas_per_sm<{element}, {d}>(p);
}}
{append}
}}  // namespace flash_attn_ext::sm80
"""

SM80_APPEND = """
template <>
cudaError_t run_kvcache_append<{element}>(const DecodeParams& p, cudaStream_t stream) {{
  return launch_kvcache_append<{element}>(p, stream);
}}
"""

SM90_FWD = """\
// Hopper forward instantiation: head dim {d}, {dtype}{what}.
#include "kernels/sm90/flash_fwd_sm90.cuh"

namespace flash_attn_ext::sm90 {{

template <>
cudaError_t {entry}<{element}, {d}>(const FwdParams& p, cudaStream_t stream) {{
  return launch_flash_fwd_sm90_hdim<{element}, {d}, /*kPackGQA=*/{pack}, \
/*kGeneral=*/{general}, /*kDropout=*/{dropout}{mask}>(p, stream);
}}

}}  // namespace flash_attn_ext::sm90
"""

SM90_BWD = """\
// Hopper backward instantiation: head dim {d}, {dtype}{what}.
#include "kernels/sm90/bwd_launch_template.h"

namespace flash_attn_ext::sm90 {{

template <>
cudaError_t {entry}<{element}, {d}>(const BwdParams& p, float* stats, \
cudaStream_t stream) {{
  return launch_flash_bwd_sm90<Sm90BwdTraits<{element}, {d}, /*kGeneral=*/{general}, \
/*kDropout=*/{dropout}{mask}>>(p, stats, stream);
}}

}}  // namespace flash_attn_ext::sm90
"""
SM90_BWD_HEAD_DIMS = (64, 128, 256)
# Packed sequences with one score modifier (kVarlen and that variant's flag together).
VARLEN_MODIFIER_VARIANTS = (("_varlen_softcap", ", packed sequences with softcap alone"),
                            ("_varlen_alibi", ", packed sequences with ALiBi alone"),
                            ("_varlen_dropout", ", packed sequences with dropout alone"))
# Head dim 256 (the step split by role, kernels/sm90/bwd_mainloop_split.h): plain attention,
# packed sequences (with softcap, ALiBi or dropout alone too), a boolean mask alone, dropout
# alone, softcap alone and ALiBi alone.
SM90_BWD_256_VARIANTS = ("", "_dropout", "_mask", "_varlen", "_softcap", "_alibi") + tuple(
    suffix for suffix, _ in VARLEN_MODIFIER_VARIANTS)
# (file and entry-point suffix, what the file's comment adds)
SM90_FWD_VARIANTS = (("", ""), ("_packgqa", ", GQA query heads packed into shared tiles"),
                     ("_general", ", softcap, bias, ALiBi and dropout"),
                     ("_dropout", ", dropout alone"), ("_mask", ", a boolean mask alone"),
                     ("_varlen", ", packed sequences"), ("_softcap", ", softcap alone"),
                     ("_alibi", ", ALiBi alone")) + VARLEN_MODIFIER_VARIANTS
SM90_BWD_VARIANTS = (("", ""), ("_general", ", softcap, bias, ALiBi and dropout"),
                     ("_dropout", ", dropout alone"), ("_mask", ", a boolean mask alone"),
                     ("_varlen", ", packed sequences"), ("_softcap", ", softcap alone"),
                     ("_alibi", ", ALiBi alone")) + VARLEN_MODIFIER_VARIANTS
# The variants whose kDropout template argument is true (dropout alone, packed or not).
DROPOUT_VARIANTS = ("_dropout", "_varlen_dropout")
# The kMask, kVarlen, kSoftcap and kAlibi template arguments of each variant that sets one (the
# other files predate them and write none).
VARIANT_ARGS = {
    "_mask": ", /*kMask=*/true",
    "_varlen": ", /*kMask=*/false, /*kVarlen=*/true",
    "_softcap": ", /*kMask=*/false, /*kVarlen=*/false, /*kSoftcap=*/true",
    "_alibi": ", /*kMask=*/false, /*kVarlen=*/false, /*kSoftcap=*/false, /*kAlibi=*/true",
    "_varlen_softcap": ", /*kMask=*/false, /*kVarlen=*/true, /*kSoftcap=*/true",
    "_varlen_alibi": ", /*kMask=*/false, /*kVarlen=*/true, /*kSoftcap=*/false, /*kAlibi=*/true",
    "_varlen_dropout": ", /*kMask=*/false, /*kVarlen=*/true",
}


def kernel_files():
    """{path relative to csrc/kernels: content} of every instantiation file."""
    files = {}
    for d in HEAD_DIMS:
        for dtype, element in DTYPES:
            args = dict(d=d, dtype=dtype, element=element)
            files[f"sm80/flash_fwd_hdim{d}_{dtype}.cu"] = SM80_FWD.format(**args)
            files[f"sm80/flash_bwd_hdim{d}_{dtype}.cu"] = SM80_BWD.format(**args)
            files[f"sm80/flash_decode_hdim{d}_{dtype}.cu"] = SM80_DECODE.format(
                append=SM80_APPEND.format(**args) if d == HEAD_DIMS[0] else "", **args)
            for suffix, what in SM90_FWD_VARIANTS:
                files[f"sm90/flash_fwd_sm90_hdim{d}_{dtype}{suffix}.cu"] = SM90_FWD.format(
                    what=what, entry="run_flash_fwd_sm90" + suffix,
                    pack=str(suffix == "_packgqa").lower(),
                    general=str(suffix == "_general").lower(),
                    dropout=str(suffix in DROPOUT_VARIANTS).lower(),
                    mask=VARIANT_ARGS.get(suffix, ""), **args)
            if d in SM90_BWD_HEAD_DIMS:
                for suffix, what in SM90_BWD_VARIANTS:
                    if d == 256 and suffix not in SM90_BWD_256_VARIANTS:
                        continue
                    files[f"sm90/flash_bwd_sm90_hdim{d}_{dtype}{suffix}.cu"] = SM90_BWD.format(
                        what=what, entry="run_flash_bwd_sm90" + suffix,
                        general=str(suffix == "_general").lower(),
                        dropout=str(suffix in DROPOUT_VARIANTS).lower(),
                        mask=VARIANT_ARGS.get(suffix, ""), **args)
    return {path: GENERATED + text for path, text in sorted(files.items())}


def is_instantiation(name):
    """Whether a file name in sm80/ or sm90/ is one this script is meant to write."""
    return name.endswith(".cu") and "_hdim" in name


def stale_files(kernels_dir=KERNELS_DIR):
    """(path, reason) for each file that differs from what the script writes, is missing, or
    looks like an instantiation the script does not write."""
    expected = kernel_files()
    stale = []
    for path, text in expected.items():
        full = os.path.join(kernels_dir, path)
        if not os.path.exists(full):
            stale.append((path, "missing"))
            continue
        with open(full, encoding="utf-8", newline="") as f:
            if f.read() != text:
                stale.append((path, "differs"))
    for sub in ("sm80", "sm90"):
        folder = os.path.join(kernels_dir, sub)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            path = f"{sub}/{name}"
            if is_instantiation(name) and path not in expected:
                stale.append((path, "not written by this script (add it here or remove it)"))
    return stale


def write_files(kernels_dir=KERNELS_DIR):
    """Writes every instantiation file that differs; returns the paths written."""
    written = []
    for path, text in kernel_files().items():
        full = os.path.join(kernels_dir, path)
        if os.path.exists(full):
            with open(full, encoding="utf-8", newline="") as f:
                if f.read() == text:
                    continue
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming the files that are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path, reason in stale:
            print(f"csrc/kernels/{path}: {reason}", file=sys.stderr)
        if stale:
            print("generate_kernels: stale instantiation files; rerun"
                  " python csrc/generate_kernels.py", file=sys.stderr)
            return 1
        print(f"generate_kernels: {len(kernel_files())} instantiation files up to date")
        return 0
    written = write_files()
    for path in written:
        print(f"wrote csrc/kernels/{path}")
    print(f"generate_kernels: {len(written)} of {len(kernel_files())} files written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
