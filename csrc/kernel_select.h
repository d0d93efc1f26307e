// The one rule that picks the CUDA kernels of a call (docs/design.md section 4).
//
// Plain C++: no torch, no CUDA.  The CUDA glue (csrc/cuda/flash_cuda.cu) asks it before every
// launch and obeys the answer; the Python module exposes it (flash_attn_ext._C.select_cuda_kernels)
// so that explain(), last_plan() and strict mode report exactly the kernels the glue launches,
// with the rule's own reasons.  Nothing else decides a kernel: a new condition goes here.
//
// Inputs: how the library was built, the GPU, the call (dtype, head dims, sizes, strides, flags)
// and the process's kernel options.  Output: whether a fused CUDA kernel serves the call at all
// (else why not), which forward (portable sm80, Hopper sm90, Hopper with packed GQA heads), which
// backward (Hopper, or the 4-warp or 8-warp portable kernels) and how that backward forms dQ.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/sm90/pack_gqa.h"
#include "params.h"

namespace flash_attn_ext {

// The head dim a CUDA kernel instantiation takes for max(head_dim, head_dim_v): 64, 128 or 256.
constexpr int64_t padded_head_dim(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Where the process's kernel options come from: the one user-facing switch (FLASH_ATTN_EXT_KERNEL
// =sm80, read once when flash_attn_ext is imported) and experimental variants that compare
// kernels in one build (tests, benchmarks and dev/ab set them through
// flash_attn_ext.kernel_options; no environment variable is read per call).
enum class PackGqa : int { kAuto = 0, kOn = 1, kOff = 2 };
enum class Sm90Schedule : int { kAuto = 0, kDynamic = 1, kStatic = 2, kTile = 3 };
enum class Sm90Bwd : int { kAuto = 0, kOn = 1, kOff = 2 };
struct KernelOptions {
  bool force_portable = false;  // the portable sm80 kernels on every GPU
  PackGqa sm90_pack_gqa = PackGqa::kAuto;
  // The Hopper forward's tile schedule: kAuto is kDynamic when a causal mask, a window, packed
  // sequences or a boolean mask whose rows differ make tiles unequal, else kStatic (one CTA per
  // SM; kDynamic takes the next tile from an atomic counter, longest first; kTile launches one
  // CTA per tile).
  Sm90Schedule sm90_schedule = Sm90Schedule::kAuto;
  // (batch, head) pairs per section of the Hopper forward's tile order, and of the Hopper
  // backward's launch order under a causal mask or window (there 1: the key block fastest over
  // the whole launch); 0: the launchers' choice
  int32_t sm90_section_pairs = 0;
  bool sm90_row_shift = true;      // causal: the partial query block first
  // The Hopper forward's O stored from registers instead of by TMA, and the Hopper backward's dK
  // and dV (head dims 64 and 128) from registers instead of through shared memory
  bool sm90_direct_epilogue = false;
  bool bwd_atomic_dq = false;  // the 8-warp backward's per-lane atomic dQ also on sm_90
  // The Hopper kernels' general variant with a bias: summarise it by blocks first
  // (kernels/sm90/bias_blocks.h: skip masked tiles, no reads where it is 0); false reads it
  // everywhere.
  bool sm90_bias_blocks = true;
  // The Hopper backward: kAuto where it measures faster than the portable one, kOn wherever it
  // applies (today both: padded head dims 64 and 128; docs/perf/sm90_backward.md), kOff never.
  Sm90Bwd sm90_bwd = Sm90Bwd::kAuto;
  // The CUDA exact passes over rows whose scores are too large for the main kernels' one-float
  // reference (cuda/exact_rows.h) on every call: the backward's (such rows come from a floating
  // bias of huge finite values, and without one from huge scores, |q.k| * scale * log2 e >=
  // 2^13: issue 29) and the forward's (plain scores).  false: the backward's only with a
  // floating bias, the forward's never (to measure what the passes cost the other calls).
  bool exact_rows_always = true;
  // The Hopper forward's softcap variant at head dim 64: of every 8 columns of S a thread
  // holds, how many take their exp2 on the FMA pipe (a polynomial) instead of the MUFU unit;
  // -1: the kernel's default (Sm90FwdTraits::kFmaExp2Of8).  Experimental: for same-build A/Bs.
  int32_t sm90_fma_exp2 = -1;
  // The Hopper forward's ALiBi and dropout variants at head dim 64: consumer warpgroups, 2
  // or 3, 128-key tiles either way; 0: the kernel's default (ALiBi 3, dropout 2).
  // Experimental: for same-build A/Bs (docs/perf/sm90_score_mods.md).
  int32_t sm90_per_score_consumers = 0;
  // The Hopper forward's ALiBi variant at head dim 64 with its term in the Q K^T GEMM (one more
  // 16-column K step; fwd_kernel.h's fold_alibi says where), else per score.  Experimental:
  // for same-build A/Bs (docs/perf/sm90_score_mods.md).
  bool sm90_alibi_fold = true;
  // The Hopper forward's softcap and ALiBi variants at head dim 64 with 96-key tiles
  // (fwd_block_n's kNarrow) instead of their default 128, with the same consumer warpgroups.
  // Experimental: for same-build A/Bs (docs/perf/sm90_score_mods.md).
  bool sm90_narrow_tiles = false;
  // The Hopper forward on packed sequences: its tile table by sequence (each sequence's query
  // blocks together, the heaviest first; sequences by their heaviest block) in sections of
  // heads, as the dense order's (batch, head) pairs, so that the CTAs running at once share K
  // and V (the default); false: the table by weight alone with the heads fastest, the form
  // before, kept for same-build A/Bs (docs/perf/sm90_forward.md, "Packed sequences").
  bool sm90_varlen_sections = true;
  // The Hopper forward's mask variant at head dim 64: the summary also records which rows of
  // the mask are key intervals (a causal, padding or window mask's are), and mixed blocks mask
  // those rows by comparisons instead of reading a byte per score (the default; at 128 and
  // 256 the summary's extra cost outweighed the kernel's gain, so they read the bytes);
  // false: the bytes, kept for same-build A/Bs (docs/perf/sm90_score_mods.md).
  bool sm90_mask_rows = true;
  // The Hopper backward's mask variant at head dims 64 and 128: the summary also records which
  // keys of a mask with a value per row and key are row intervals (a causal, padding or window
  // mask's are), and mixed steps mask a thread's two keys by comparisons where both are,
  // instead of reading a byte per score (a CTA keeps its keys for all its steps, so a thread's
  // two intervals are read from L1 each step, after the wait for S^T); false: the bytes, kept
  // for same-build A/Bs (docs/perf/sm90_score_mods.md).
  bool sm90_mask_cols = true;
  // The Hopper backward's dropout variant at head dim 64 (dense calls) with 64-row steps
  // (Sm90BwdTraits::kShortSteps, the default); false: 128, as the other variants take there,
  // kept for same-build A/Bs (docs/perf/sm90_score_mods.md).
  bool sm90_bwd_short_steps = true;
  // The decode kernel's loads at head dim 64: lanes per 128-byte cache row of a copy
  // instruction, 2 (16 rows an instruction), 4 or 8 (a whole row per 8 lanes); 0: the kernel's
  // default (4).  Other head dims take 8 always.  Experimental: for same-build A/Bs
  // (docs/perf/decode.md, "The loads").
  int32_t decode_row_lanes = 0;
  // The decode call's combine kernel launched as a programmatic dependent of its attention
  // kernel on sm_90 (its launch and start overlap the attention kernel's tail); false: an
  // ordinary launch after it.  Experimental: for same-build A/Bs (docs/perf/decode.md).
  bool decode_pdl = true;
  // The decode kernel's loads from a contiguous cache (no block_table) by row offsets alone;
  // false: through the per-row lookup the paged cache takes (the form before, for same-build
  // A/Bs; docs/perf/decode.md, "The loads' and the prologue's instructions").  Experimental.
  bool decode_contiguous_loads = true;
  // Query rows one decode CTA takes where the head dim is at most 128: 16 or 32 (0: the rule,
  // decode_block_rows: 32 where a KV head has more than 16 packed rows and the call at least 32
  // such CTAs).  16 for an MQA group of 32 heads gives two CTAs per split, each with the
  // lighter 16-row form (its keys read twice, the second time mostly from L2).  Head dim 256
  // takes 16 always.  Experimental: for same-build A/Bs (docs/perf/decode.md).
  int32_t decode_block_rows = 0;
  // Splits one warp of the decode combine reads before a row's splits are spread over more
  // warps: 4, 8 or 16 (0: the default, kCombineSplitsPerWarp); fewer: more warps per row and
  // fewer dependent load batches each.  Experimental: for same-build A/Bs (docs/perf/decode.md).
  int32_t decode_combine_splits = 0;
  // Decode CTAs per SM the split heuristic takes as resident, to trim a grid that ends in a
  // partial wave of them (its target stays two per SM, one at head dim 256): 1-4 (0: the
  // occupancy of the kernel the other decode options pick,
  // cudaOccupancyMaxActiveBlocksPerMultiprocessor: on the H100 / H200 with sm_90 code 4 / 3 at
  // head dim 64 with 16 / 32 rows and the default loads, 2 at 128, 1 at 256; sm_80 code, other
  // GPUs and the load forms differ, docs/perf/decode.md).  Experimental: for same-build A/Bs
  // (docs/perf/decode.md, "The slots").
  int32_t decode_ctas_per_sm = 0;
};

enum class FwdKernel : int { kNone = 0, kSm80 = 1, kSm90 = 2, kSm90PackGqa = 3 };
enum class BwdKernel : int { kNone = 0, kSm80FourWarp = 1, kSm80EightWarp = 2, kSm90 = 3 };
// How the 8-warp backward forms dQ: a separate dQ kernel (bitwise reproducible), fp32 atomics
// from the dK/dV kernel, or bulk reductions of whole dQ tiles from it (sm_90).  The Hopper
// backward adds whole dQ tiles by bulk reductions: kAtomic for it means in the order the CTAs
// get there, kOrdered in a fixed order of key blocks (bitwise reproducible;
// kernels/sm90/bwd_dq.h).
enum class DqPath : int { kSeparate = 0, kAtomic = 1, kBulk = 2, kOrdered = 3 };

struct BuildInfo {
  bool cuda = false;      // CUDA kernels compiled in
  bool sm90 = false;      // the Hopper kernels compiled in
  std::string archs;      // TORCH_CUDA_ARCH_LIST of the build, e.g. "8.0;9.0a"
};

struct DeviceInfo {
  int major = 0, minor = 0;
  int smem_optin = 0;  // largest dynamic shared memory per block; 0 = unknown
};

// A tensor as the rule sees it: sizes and element strides in (batch, seqlen, heads, head_dim).
struct TensorDesc {
  int64_t size[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};
};

// CallInfo::score_mods, bit by bit (the Python planning passes the same int).
enum ScoreMod : int {
  kSoftcap = 1,   // softcap > 0
  kBias = 2,      // an attn_mask / attn_bias (additive, fp32 in the kernels)
  kDropout = 4,   // dropout_p > 0
  kBiasGrad = 8,  // the bias needs a gradient (the backward writes dS out)
  kAlibi = 16,    // alibi_slopes
  kMask = 32,     // the bias is a boolean mask (with kBias)
};

// A boolean mask and nothing else: the Hopper kernels' mask variant reads it as it is (every
// other kernel gets it as an additive fp32 bias).
constexpr bool mask_alone(int score_mods) { return score_mods == (kBias | kMask); }

struct CallInfo {
  std::string dtype;  // "bf16", "fp16", "fp32", "fp64"
  bool has_scale = false;
  double softmax_scale = 0.0;
  int64_t head_dim = 0, head_dim_v = 0;
  // Sizes and strides of q, k, v; with known = false (a call traced with symbolic sizes) the
  // rule decides only what does not depend on them: whether a fused kernel serves the call, and
  // the kernels' families.  The op then applies the whole rule with the real sizes.
  bool known = true;
  TensorDesc q, k, v;
  // What the call adds to plain attention (ScoreMod bits): the Hopper kernels' general
  // variant takes softcap, a bias and ALiBi (with dropout or not), their dropout variant
  // dropout alone, their softcap and ALiBi variants softcap or ALiBi alone, their mask
  // variant a boolean mask alone; a bias's gradient runs on the portable backward.
  int score_mods = 0;
  bool general() const { return score_mods != 0; }
  bool unequal_tiles = false;  // a causal mask or window: query tiles see unequal key ranges
  // The bias differs between query rows (a (B, 1, L, S) mask, as transformers passes causal +
  // padding): its masked blocks may leave query tiles unequal work, as a causal mask does.
  bool bias_rows_differ = false;
  bool deterministic = false;  // the call's flag or torch.use_deterministic_algorithms
  // Packed sequences (the varlen ops; q, k, v described as (1, total, heads, head_dim)): the
  // Hopper forward's and backward's varlen instantiations take plain attention and softcap,
  // ALiBi or dropout alone (the backward deterministic too); else the 4-warp kernels with the
  // separate dQ kernel.
  bool packed = false;
};

struct KernelChoice {
  bool fused = false;
  std::vector<std::string> reasons;  // why no fused CUDA kernel serves the call (fused = false)
  int64_t head_dim = 0;              // padded: the instantiation's
  FwdKernel fwd = FwdKernel::kNone;
  BwdKernel bwd = BwdKernel::kNone;
  DqPath dq = DqPath::kSeparate;
  Sm90Schedule sm90_schedule = Sm90Schedule::kAuto;  // resolved (never kAuto) for kSm90*
  // Why a fused but slower kernel serves the call (the portable forward on sm_90, the 4-warp
  // backward, the separate dQ kernel).
  std::vector<std::string> notes;
  std::string fwd_name, bwd_name;  // e.g. "sm90_fwd_hdim128_bf16", "sm80_bwd_hdim128_bf16"
};

namespace detail {

// Why a call wants bitwise-reproducible gradients, as the notes say it.
constexpr const char* kDeterministicWhy =
    "deterministic=True or torch.use_deterministic_algorithms(True)";

inline std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// A double as Python's repr writes it for ordinary values ("-1.0", "-0.3", "inf"): the fewest
// significant digits that read back as the same double.
inline std::string number(double x) {
  std::string s;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream os;
    os << std::setprecision(digits) << x;
    s = os.str();
    if (std::strtod(s.c_str(), nullptr) == x) break;
  }
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

inline std::string torch_dtype_name(const std::string& dtype) {
  if (dtype == "bf16") return "torch.bfloat16";
  if (dtype == "fp16") return "torch.float16";
  if (dtype == "fp32") return "torch.float32";
  if (dtype == "fp64") return "torch.float64";
  return dtype;
}

// A TMA descriptor cannot describe a broadcast (stride-0) dimension.  The glue copies tensors
// whose strides are not multiples of 8 elements (kernel_ready, which removes broadcasts), so
// only tensors it passes through as they are can carry one to the Hopper kernel.
inline bool broadcast_reaches_tma(const TensorDesc& t) {
  const bool as_is = t.stride[3] == 1 && t.size[3] % 8 == 0 && t.stride[0] % 8 == 0 &&
                     t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0;
  if (!as_is) return false;
  for (int i = 0; i < 3; ++i)
    if (t.size[i] > 1 && t.stride[i] == 0) return true;
  return false;
}

// Why neither Hopper kernel (forward or backward) serves a call on an sm_90 GPU; empty if
// nothing stands in the way.
inline std::vector<std::string> hopper_blockers(const BuildInfo& build, const CallInfo& call,
                                                const KernelOptions& options) {
  std::vector<std::string> why;
  if (!build.sm90)
    why.push_back("this build has no Hopper kernels (they need 9.0a in TORCH_CUDA_ARCH_LIST "
                  "and the CUTLASS headers at build time: pip install --no-deps "
                  "nvidia-cutlass==4.2.0.0 and rebuild)");
  if (options.force_portable) why.push_back("FLASH_ATTN_EXT_KERNEL=sm80");
  if (call.known) {
    const int64_t seqlen_q = call.q.size[1], seqlen_k = call.k.size[1];
    if (seqlen_q == 0 || seqlen_k == 0) why.push_back("an empty sequence");
    if (seqlen_q > sm90::kMaxRows || seqlen_k > sm90::kMaxRows)
      why.push_back("seqlen_q=" + std::to_string(seqlen_q) + ", seqlen_k=" +
                    std::to_string(seqlen_k) + ": the Hopper kernel's row arithmetic is "
                    "32-bit (at most " + std::to_string(sm90::kMaxRows) + ")");
    const char* names[3] = {"q", "k", "v"};
    const TensorDesc* tensors[3] = {&call.q, &call.k, &call.v};
    for (int i = 0; i < 3; ++i)
      if (broadcast_reaches_tma(*tensors[i]))
        why.push_back(std::string(names[i]) +
                      " has a broadcast (stride-0) dimension, which TMA cannot load");
  }
  return why;
}

// The name suffix of the Hopper kernels' variant a call runs on (forward and backward alike):
// dropout alone, a boolean mask alone, softcap alone, ALiBi alone, the general variant
// (softcap, a bias, ALiBi; dropout with them), or plain.
inline const char* sm90_variant(const CallInfo& call) {
  return call.score_mods == kDropout     ? "_dropout"
         : mask_alone(call.score_mods) ? "_mask"
         : call.score_mods == kSoftcap  ? "_softcap"
         : call.score_mods == kAlibi    ? "_alibi"
         : call.general()               ? "_general"
                                        : "";
}

// Whether the Hopper kernels take packed sequences (CallInfo::packed) with these score
// modifiers: plain attention, or softcap, ALiBi or dropout alone (their varlen variants; two or
// more together stay on the portable kernels).
inline bool sm90_varlen_takes(int score_mods) {
  return score_mods == 0 || score_mods == kSoftcap || score_mods == kAlibi ||
         score_mods == kDropout;
}
// The same name suffix for packed sequences, which sm90_varlen_takes.
inline const char* sm90_varlen_variant(const CallInfo& call) {
  return call.score_mods == kSoftcap  ? "_varlen_softcap"
         : call.score_mods == kAlibi  ? "_varlen_alibi"
         : call.score_mods == kDropout ? "_varlen_dropout"
                                       : "_varlen";
}
// Why the Hopper kernels leave a packed call to the portable ones (not sm90_varlen_takes).
inline constexpr const char* kVarlenModsWhy =
    "the Hopper kernels take packed sequences (cu_seqlens) with at most one of softcap, "
    "alibi_slopes and dropout";

}  // namespace detail

// Whether a build for TORCH_CUDA_ARCH_LIST-style `archs` (e.g. "8.0;9.0a") has code that runs on
// a GPU of compute capability (major, minor): machine code (SASS) for the same major version and
// a minor version not above the GPU's ("9.0a" counts only on 9.0 itself), or PTX ("+PTX") for a
// version not above the GPU's, which the driver compiles.  With native_only, PTX does not count.
inline bool arch_runs_on(const std::string& archs, int major, int minor, bool native_only = false) {
  // Parsed by hand, without allocating: the glue asks this on every call.
  auto number = [](const char* p, const char* end, int& value) {
    if (p == end) return false;
    value = 0;
    for (; p != end; ++p) {
      if (*p < '0' || *p > '9') return false;
      value = value * 10 + (*p - '0');
    }
    return true;
  };
  const char* p = archs.data();
  const char* const stop = p + archs.size();
  while (p < stop) {
    const char* begin = p;
    while (p < stop && *p != ';' && *p != ' ') ++p;
    const char* end = p++;  // (past the separator)
    const bool ptx = end - begin > 4 && std::strncmp(end - 4, "+PTX", 4) == 0;
    if (ptx) end -= 4;
    const bool specific = end > begin && end[-1] == 'a';
    if (specific) --end;
    const char* dot = begin;
    while (dot < end && *dot != '.') ++dot;
    int a = 0, b = 0;
    if (dot == end || !number(begin, dot, a) || !number(dot + 1, end, b)) continue;
    if (specific) {
      if (a == major && b == minor) return true;
    } else if (a == major && b <= minor) {
      return true;
    }
    if (!native_only && ptx && !specific && (a < major || (a == major && b <= minor))) return true;
  }
  return false;
}

// The rule.  Reads nothing but its arguments.
inline KernelChoice select_cuda_kernels(const BuildInfo& build, const DeviceInfo& device,
                                        const CallInfo& call, const KernelOptions& options) {
  KernelChoice c;
  const int64_t d = padded_head_dim(call.head_dim > call.head_dim_v ? call.head_dim
                                                                    : call.head_dim_v);
  c.head_dim = d;
  // 1. Is there a fused CUDA kernel for this call at all?
  if (!build.cuda)
    c.reasons.push_back("this build of flash_attn_ext has no CUDA kernels (built without CUDA; "
                        "see FLASH_ATTN_EXT_CUDA in README.md)");
  if (call.dtype != "bf16" && call.dtype != "fp16")
    c.reasons.push_back("q.dtype=" + detail::torch_dtype_name(call.dtype) +
                        ": the CUDA kernels take float16 and bfloat16 (cast the inputs or use "
                        "torch.autocast)");
  if (call.has_scale && !(call.softmax_scale > 0.0))
    // The kernels track the running max on raw q.k and scale afterwards: that needs scale > 0.
    c.reasons.push_back("softmax_scale=" + detail::number(call.softmax_scale) +
                        ": the CUDA kernels take a positive scale (softmax_scale > 0)");
  if (c.reasons.empty()) {
    const std::string gpu = "GPU sm_" + std::to_string(device.major) + std::to_string(device.minor);
    if (device.major < 8)
      c.reasons.push_back(gpu + ": the CUDA kernels need sm_80 or newer");
    else if (!arch_runs_on(build.archs, device.major, device.minor))
      c.reasons.push_back(gpu + ": this build's CUDA code (" + build.archs +
                          ") does not run on it (rebuild with its arch in TORCH_CUDA_ARCH_LIST, "
                          "or a +PTX arch)");
  }
  if (c.reasons.empty()) {
    const int need = portable_bwd_smem_bytes(static_cast<int>(d));
    if (device.smem_optin > 0 && device.smem_optin < need)
      c.reasons.push_back("head_dim=" + std::to_string(call.head_dim > call.head_dim_v
                                                           ? call.head_dim
                                                           : call.head_dim_v) +
                          ": the backward kernel needs " + std::to_string(need) +
                          " bytes of shared memory per block, this GPU allows " +
                          std::to_string(device.smem_optin) + " (e.g. sm_86/sm_89)");
  }
  if (!c.reasons.empty()) return c;
  c.fused = true;
  const std::string suffix = "_hdim" + std::to_string(d) + "_" + call.dtype;

  // 2. The forward: the Hopper kernel on sm_90 where it applies, else the portable one.
  c.fwd = FwdKernel::kSm80;
  const bool hopper = device.major == 9 && device.minor == 0;
  const std::vector<std::string> hopper_why =
      hopper ? detail::hopper_blockers(build, call, options) : std::vector<std::string>{};
  if (hopper) {
    if (hopper_why.empty()) {
      c.fwd = FwdKernel::kSm90;
      // (packed sequences: tiles of unequal lengths whatever the mask.  A boolean mask whose
      // rows differ: the mask variant skips its fully masked tiles, and the dynamic schedule
      // measured 3-10% faster than the static one on a (B, 1, L, S) causal + padding mask at
      // head dims 64-256, docs/perf/sm90_score_mods.md; a float bias runs the general variant,
      // not measured there.)
      const bool unequal = call.unequal_tiles || call.packed ||
                           (mask_alone(call.score_mods) && call.bias_rows_differ);
      c.sm90_schedule = options.sm90_schedule != Sm90Schedule::kAuto ? options.sm90_schedule
                        : unequal ? Sm90Schedule::kDynamic
                                  : Sm90Schedule::kStatic;
      if (call.packed && !detail::sm90_varlen_takes(call.score_mods)) {
        c.fwd = FwdKernel::kSm80;
        c.notes.push_back(std::string("forward on the portable sm80 kernels, not the Hopper "
                                      "one, because ") + detail::kVarlenModsWhy);
      }
    } else {
      c.notes.push_back("forward and backward on the portable sm80 kernels, not the Hopper "
                        "ones, because " + detail::join(hopper_why, "; "));
    }
  }
  if (c.fwd == FwdKernel::kSm90 && call.known && !call.packed) {
    const int64_t seqlen_q = call.q.size[1], heads_q = call.q.size[2], heads_kv = call.k.size[2];
    bool pack = false;
    if (heads_q != heads_kv && !call.general()) {  // (the general variant does not pack)
      switch (options.sm90_pack_gqa) {
        case PackGqa::kAuto: pack = sm90::pack_gqa_pays(seqlen_q, heads_q, heads_kv, d); break;
        case PackGqa::kOn: pack = sm90::pack_gqa_possible(seqlen_q, heads_q, heads_kv); break;
        case PackGqa::kOff: pack = false; break;
      }
    }
    if (pack) c.fwd = FwdKernel::kSm90PackGqa;
  }
  c.fwd_name = (c.fwd == FwdKernel::kSm80 ? "sm80_fwd" : "sm90_fwd") + suffix +
               (c.fwd == FwdKernel::kSm90PackGqa ? "_packgqa"
                : c.fwd != FwdKernel::kSm90      ? ""
                : call.packed                    ? detail::sm90_varlen_variant(call)
                                                 : detail::sm90_variant(call));

  // Packed sequences: the Hopper backward's varlen instantiations for plain attention and
  // softcap, ALiBi or dropout alone (dQ added in any order, or in a fixed order when
  // deterministic), else the 4-warp backward with its separate dQ kernel (per-sequence
  // offsets; bitwise reproducible).
  if (call.packed) {
    std::vector<std::string> why;
    if (hopper && hopper_why.empty()) {  // (else the forward's note says why)
      if (!detail::sm90_varlen_takes(call.score_mods)) why.push_back(detail::kVarlenModsWhy);
      if (options.sm90_bwd == Sm90Bwd::kOff) why.push_back("kernel option sm90_bwd='off'");
      if (why.empty()) {
        c.bwd = BwdKernel::kSm90;
        c.dq = DqPath::kAtomic;
        if (call.deterministic) {
          c.dq = DqPath::kOrdered;
          c.notes.push_back(std::string("backward dQ added in a fixed order (each sequence's "
                                        "key blocks, the highest first; a counter per query "
                                        "block), because ") +
                            detail::kDeterministicWhy + ": bitwise-reproducible gradients");
        }
        c.bwd_name = "sm90_bwd" + suffix + detail::sm90_varlen_variant(call);
        return c;
      }
    }
    c.bwd = BwdKernel::kSm80FourWarp;
    c.dq = DqPath::kSeparate;
    c.bwd_name = "sm80_bwd" + suffix;
    c.notes.push_back(std::string("backward on the 4-warp sm80 kernels with the separate dQ "
                                  "kernel, ") +
                      (why.empty() ? "because the 8-warp kernels do not take packed sequences "
                                     "(cu_seqlens)"
                                   : "not the Hopper one, because " + detail::join(why, "; ")));
    return c;
  }

  // 3. The backward: the Hopper kernel (kernels/sm90/bwd_*.h) on sm_90 where it applies (head
  // dim 256: plain attention, a boolean mask alone, dropout alone, softcap alone or ALiBi
  // alone), else the 8-warp kernels (flash_bwd_lean.cuh) for plain attention where their shared
  // memory fits the GPU, else the 4-warp ones; their dQ by bulk reductions on sm_90 (its tile
  // fits up to head dim 128, and the kernels must run as sm_90 machine code), atomics
  // elsewhere, a separate kernel for bitwise-reproducible gradients.
  if (hopper && hopper_why.empty()) {  // (else the forward's note says why)
    std::vector<std::string> why;
    // (head dim 256: the step split by role, plain attention, a boolean mask alone, dropout
    // alone, softcap alone or ALiBi alone; kernels/sm90/bwd_mainloop_split.h)
    if (d > 128 && call.score_mods != 0 && call.score_mods != kSoftcap &&
        call.score_mods != kAlibi && call.score_mods != kDropout &&
        !mask_alone(call.score_mods))
      why.push_back("head_dim=" + std::to_string(d) + " (padded): the Hopper backward takes "
                    "a float attn_bias, or modifiers together, at head dims up to 128 only (at "
                    "256: a boolean attn_mask alone, dropout alone, softcap alone or "
                    "alibi_slopes alone)");
    if (call.score_mods & kBiasGrad)
      why.push_back("attn_mask/attn_bias requires grad: its gradient is written by the portable "
                    "backward");
    if (options.sm90_bwd == Sm90Bwd::kOff) why.push_back("kernel option sm90_bwd='off'");
    if (why.empty()) {
      c.bwd = BwdKernel::kSm90;
      c.dq = DqPath::kAtomic;
      if (call.deterministic) {
        c.dq = DqPath::kOrdered;
        c.notes.push_back(std::string("backward dQ added in a fixed order of key blocks (a "
                                      "counter per query block), because ") +
                          detail::kDeterministicWhy + ": bitwise-reproducible gradients");
      }
      c.bwd_name = "sm90_bwd" + suffix + detail::sm90_variant(call);
      return c;
    }
    c.notes.push_back("backward on the portable sm80 kernels, not the Hopper one, because " +
                      detail::join(why, "; "));
  }
  std::vector<std::string> why;
  if (call.general())
    why.push_back("softcap, attn_mask/attn_bias, alibi_slopes and dropout run on them");
  const int lean_need = lean_bwd_smem_bytes(static_cast<int>(d));
  if (device.smem_optin > 0 && device.smem_optin < lean_need)
    why.push_back("they need " + std::to_string(lean_need) +
                  " bytes of shared memory per block, this GPU allows " +
                  std::to_string(device.smem_optin));
  if (why.empty()) {
    c.bwd = BwdKernel::kSm80EightWarp;
    if (call.deterministic) {
      c.dq = DqPath::kSeparate;
      c.notes.push_back(std::string("backward dQ on the separate dQ kernel, not accumulated "
                                    "in the dK/dV pass, because ") +
                        detail::kDeterministicWhy +
                        ": bitwise-reproducible gradients at ~0.75x the default backward's "
                        "speed");
    } else {
      const bool bulk = device.major == 9 && d <= 128 && !options.bwd_atomic_dq &&
                        arch_runs_on(build.archs, device.major, device.minor, true);
      c.dq = bulk ? DqPath::kBulk : DqPath::kAtomic;
    }
  } else {
    c.bwd = BwdKernel::kSm80FourWarp;
    c.dq = DqPath::kSeparate;
    c.notes.push_back("backward on the 4-warp sm80 kernels, not the faster 8-warp ones, because " +
                      detail::join(why, "; "));
  }
  c.bwd_name = "sm80_bwd" + suffix;
  return c;
}

}  // namespace flash_attn_ext

namespace flash_attn_ext {

// The process's kernel options (csrc/kernel_select.cpp): a copy is read once per call by the
// glue and by the Python module's planning; set_kernel_options replaces them as a whole.
KernelOptions kernel_options();
void set_kernel_options(const KernelOptions& options);

}  // namespace flash_attn_ext
