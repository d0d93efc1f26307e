// Times the portable (sm80) CUDA kernels without PyTorch, for A/B comparisons of kernel variants
// that cost no build on the GPU machine: dev/ab/kernel_ab.sh compiles this file with the
// kernel translation units of a source tree (bf16, head dims 64, 128, 256) into one binary per
// tree on a machine without a GPU; the GPU machine only runs the binaries, alternately.
//
// Shapes as benchmarks/bench_attention.py: bf16, inputs (B, L, H, d) contiguous, B * L = 16384
// tokens, H * d = 2048; values uniform in [-2, 2) from a hash of (tensor, index), or standard
// normal with --data normal (torch.randn's distribution, as dev/ab/peers_fwd.py uses).  Per (d, L, causal) the forward runs once to produce out and
// softmax_lse, then the forward (run_flash_fwd) and the backward (run_flash_bwd: delta, dK/dV
// with atomic dQ into a zeroed fp32 buffer, conversion; or with --deterministic the separate
// dQ kernel) are timed: CUDA events around `reps` launches, the median of 7 such groups.
// TFLOP/s the FlashAttention way: forward 4 B H L^2 d, halved when causal; backward 2.5x.
// Also a consistency check (not a correctness test: tests/test_cuda.py is): the atomic-dQ and
// the deterministic backward's dq, dk, dv, as max |difference| / max |value| per gradient.
//
// Built with -DFLASH_ATTN_EXT_SM90 and the sm90 forward translation units (dev/ab/kernel_ab.sh
// with SM90=1), --fwd sm90 times the Hopper forward instead (its tile counter zeroed by its
// launcher, as in the extension) and compares its out and softmax_lse with the sm80 forward's
// (max |diff| / max |value|, max |diff|): a consistency check of kernel variants, not a test.
// --schedule static|dynamic overrides its tile scheduler (default: as the extension, dynamic
// under a causal mask, static otherwise).
//
// --layout bhsd stores q, k, v, out (and the gradients) as (B, H, L, d) instead (what
// bench_attention.py passes to every implementation).
//
// Usage: kernel_ab [--dims 64 128] [--seqlens 2048 16384] [--causal no|yes|both]
//                  [--reps 10] [--deterministic] [--fwd sm80|sm90] [--no-bwd]
//                  [--layout bshd|bhsd] [--data uniform|normal] [--section PAIRS]
//                  [--tag NAME] [--addresses]
//
// --addresses prints each case's q, k, v and out device addresses (offsets within 2 MiB pages
// and the pages' numbers), to relate run-to-run differences of one binary to where its buffers
// landed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/sm80/flash_bwd_launch.h"
#include "kernels/sm80/flash_fwd_launch.h"
#ifdef FLASH_ATTN_EXT_SM90
#include "kernels/sm90/flash_fwd_sm90_launch.h"
#endif
#include "params.h"

namespace {

using flash_attn_ext::BwdParams;
using Element = __nv_bfloat16;

#define CHECK_CUDA(expr)                                                              \
  do {                                                                                \
    const cudaError_t err_ = (expr);                                                  \
    if (err_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,              \
                   cudaGetErrorString(err_));                                         \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

__device__ float to_float(float x) { return x; }
__device__ float to_float(Element x) { return __bfloat162float(x); }

// max |a - b| (infinity where it is NaN) and max |b| over n elements, atomically into out[0],
// out[1] (both >= 0).
template <typename T>
__global__ void diff_kernel(const T* a, const T* b, int64_t n, float* out) {
  float d = 0.f, m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float y = to_float(b[i]), e = to_float(a[i]) - y;
    d = e == e ? fmaxf(d, fabsf(e)) : INFINITY;
    m = fmaxf(m, fabsf(y));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(d));
  atomicMax(reinterpret_cast<int*>(out + 1), __float_as_int(m));
}

// {max |a - b|, max |b|}.
template <typename T>
std::pair<double, double> max_diff(const T* a, const T* b, int64_t n) {
  float* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, 2 * sizeof(float)));
  CHECK_CUDA(cudaMemset(out, 0, 2 * sizeof(float)));
  diff_kernel<<<1024, 256>>>(a, b, n, out);
  float h[2];
  CHECK_CUDA(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(out));
  return {h[0], h[1]};
}

double abs_diff(const float* a, const float* b, int64_t n) { return max_diff(a, b, n).first; }

// max |a - b| / max |b|.
double rel_diff(const Element* a, const Element* b, int64_t n) {
  const auto [d, m] = max_diff(a, b, n);
  return m > 0.0 ? d / m : (d > 0.0 ? INFINITY : 0.0);
}

__device__ uint32_t hash(uint32_t i, uint32_t seed) {
  uint32_t h = i * 0x9E3779B9u ^ seed * 0x85EBCA6Bu;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

// Uniform in [-2, 2), or standard normal (Box-Muller; what torch.randn gives the peers).
__global__ void fill_kernel(Element* x, int64_t n, uint32_t seed, bool normal) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = ((hash(static_cast<uint32_t>(i), seed) >> 8) + 0.5f) / 16777216.f;
    if (normal) {
      const float w = (hash(static_cast<uint32_t>(i), seed + 7919u) >> 8) / 16777216.f;
      x[i] = __float2bfloat16(sqrtf(-2.f * logf(u)) * cospif(2.f * w));
    } else {
      x[i] = __float2bfloat16(u * 4.f - 2.f);
    }
  }
}

bool g_normal = false;  // --data normal

Element* random_tensor(int64_t n, uint32_t seed) {
  Element* x = nullptr;
  CHECK_CUDA(cudaMalloc(&x, n * sizeof(Element)));
  fill_kernel<<<1024, 256>>>(x, n, seed, g_normal);
  CHECK_CUDA(cudaGetLastError());
  return x;
}

// Median over 7 groups of the mean ms per call of `reps` back-to-back calls.
double median_ms(const std::function<void()>& fn, int reps) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();  // warm-up (shared-memory opt-in, clocks)
  std::vector<double> ms;
  for (int g = 0; g < 7; ++g) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < reps; ++i) fn();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(double(t) / reps);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Options {
  int reps = 10;
  bool deterministic = false, sm90 = false, bwd = true, bhsd = false;
  int section = 0;  // --section: the Hopper forward's (batch, head) pairs per section
  int schedule = 0;  // --schedule: 0 as the extension, 1 static, 2 dynamic (Hopper forward)
  std::string tag = "ours";
  bool addresses = false;
};

template <int kHeadDim>
void run_case(int64_t seqlen, bool causal, const Options& o) {
  const int reps = o.reps;
  const bool deterministic = o.deterministic;
  const char* tag = o.tag.c_str();
  const int64_t d = kHeadDim, batch = std::max<int64_t>(1, 16384 / seqlen), heads = 2048 / d;
  const int64_t n = batch * seqlen * heads * d;
  BwdParams p;
  Element* q = random_tensor(n, 1);
  Element* k = random_tensor(n, 2);
  Element* v = random_tensor(n, 3);
  Element* dout = random_tensor(n, 4);
  Element *out, *dq, *dk, *dv;
  float *lse, *delta, *dq_accum;
  CHECK_CUDA(cudaMalloc(&out, n * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&dq, n * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&dk, n * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&dv, n * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&lse, batch * heads * seqlen * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&delta, batch * heads * seqlen * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dq_accum, flash_attn_ext::dq_accum_floats(batch, seqlen, heads, d) *
                                        sizeof(float)));
  p.q = q, p.k = k, p.v = v, p.out = out, p.softmax_lse = lse, p.dout = dout;
  p.dq = dq, p.dk = dk, p.dv = dv;
  p.batch = batch, p.seqlen_q = p.seqlen_k = seqlen, p.heads_q = p.heads_kv = heads;
  p.head_dim = p.head_dim_v = d;
  const int64_t batch_stride = seqlen * heads * d, row_stride = o.bhsd ? d : heads * d,
                head_stride = o.bhsd ? seqlen * d : d;
  for (int64_t* s : {&p.q_batch_stride, &p.k_batch_stride, &p.v_batch_stride,
                     &p.out_batch_stride, &p.dout_batch_stride, &p.dq_batch_stride,
                     &p.dk_batch_stride, &p.dv_batch_stride})
    *s = batch_stride;
  for (int64_t* s : {&p.q_row_stride, &p.k_row_stride, &p.v_row_stride, &p.out_row_stride,
                     &p.dout_row_stride, &p.dq_row_stride, &p.dk_row_stride, &p.dv_row_stride})
    *s = row_stride;
  for (int64_t* s : {&p.q_head_stride, &p.k_head_stride, &p.v_head_stride, &p.out_head_stride,
                     &p.dout_head_stride, &p.dq_head_stride, &p.dk_head_stride,
                     &p.dv_head_stride})
    *s = head_stride;
  p.softmax_scale = 1.0 / std::sqrt(double(d));
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  p.deterministic = deterministic;
  p.dq_accum = deterministic ? nullptr : dq_accum;

  int32_t* tile_counter = nullptr;
  CHECK_CUDA(cudaMalloc(&tile_counter, sizeof(int32_t)));
  // Zeroed once here too (the launcher zeroes it before every launch; a variant that leaves
  // that to the kernel itself finds it zero on its first launch).
  CHECK_CUDA(cudaMemset(tile_counter, 0, sizeof(int32_t)));
  auto fwd_sm80 = [&] {
    CHECK_CUDA((flash_attn_ext::sm80::run_flash_fwd<Element, kHeadDim>(p, nullptr)));
  };
  auto fwd = [&] {
#ifdef FLASH_ATTN_EXT_SM90
    if (o.sm90) {
      // as the extension: the dynamic tile scheduler under a causal mask, static otherwise
      flash_attn_ext::FwdParams f = p;
      f.tile_counter = (o.schedule == 0 ? causal : o.schedule == 2) ? tile_counter : nullptr;
      f.heads_per_section = o.section;
      CHECK_CUDA((flash_attn_ext::sm90::run_flash_fwd_sm90<Element, kHeadDim>(f, nullptr)));
      return;
    }
#endif
    fwd_sm80();
  };
  auto bwd = [&] {
    CHECK_CUDA((flash_attn_ext::sm80::run_flash_bwd<Element, kHeadDim>(p, delta, nullptr)));
  };
  fwd();
  CHECK_CUDA(cudaDeviceSynchronize());
  if (o.addresses) {
    std::printf("%s   addresses (2 MiB page:offset):", tag);
    for (const void* ptr : {static_cast<const void*>(q), static_cast<const void*>(k),
                            static_cast<const void*>(v), static_cast<const void*>(out)}) {
      const auto a = reinterpret_cast<uintptr_t>(ptr);
      std::printf(" %llx:%llx", static_cast<unsigned long long>(a >> 21),
                  static_cast<unsigned long long>(a & ((uintptr_t{1} << 21) - 1)));
    }
    std::printf("\n");
  }
  const double flops = 4.0 * batch * heads * double(seqlen) * seqlen * d / (causal ? 2 : 1);
  const double fwd_ms = median_ms(fwd, reps);
  if (o.bwd) {
    const double bwd_ms = median_ms(bwd, reps);
    std::printf("%s d=%3d L=%5lld causal=%d fwd %7.3f ms %6.1f TFLOP/s  bwd %7.3f ms %6.1f "
                "TFLOP/s\n", tag, kHeadDim, static_cast<long long>(seqlen), int(causal),
                fwd_ms, flops / fwd_ms * 1e-9, bwd_ms, 2.5 * flops / bwd_ms * 1e-9);
  } else {
    std::printf("%s d=%3d L=%5lld causal=%d fwd %7.3f ms %6.1f TFLOP/s\n", tag, kHeadDim,
                static_cast<long long>(seqlen), int(causal), fwd_ms, flops / fwd_ms * 1e-9);
  }
  if (o.sm90) {  // the sm90 forward's out and lse against the sm80 forward's
    Element* out90;
    float* lse90;
    CHECK_CUDA(cudaMalloc(&out90, n * sizeof(Element)));
    CHECK_CUDA(cudaMalloc(&lse90, batch * heads * seqlen * sizeof(float)));
    fwd();
    CHECK_CUDA(cudaMemcpy(out90, out, n * sizeof(Element), cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(lse90, lse, batch * heads * seqlen * sizeof(float),
                          cudaMemcpyDeviceToDevice));
    fwd_sm80();
    std::printf("%s   sm90 vs sm80 forward: out max|diff|/max|value| %.2e, lse max|diff| %.2e\n",
                tag, rel_diff(out90, out, n), abs_diff(lse90, lse, batch * heads * seqlen));
    CHECK_CUDA(cudaFree(out90));
    CHECK_CUDA(cudaFree(lse90));
  }
  if (o.bwd) {  // the other dQ path (atomic <-> deterministic) into copies, then compared
    Element* grads[3] = {dq, dk, dv};
    Element* copies[3];
    for (int i = 0; i < 3; ++i) {
      CHECK_CUDA(cudaMalloc(&copies[i], n * sizeof(Element)));
      CHECK_CUDA(
          cudaMemcpy(copies[i], grads[i], n * sizeof(Element), cudaMemcpyDeviceToDevice));
    }
    p.deterministic = !deterministic;
    p.dq_accum = deterministic ? dq_accum : nullptr;
    bwd();
    std::printf("%s   atomic vs deterministic: max|diff|/max|value| dq %.2e dk %.2e dv %.2e\n",
                tag, rel_diff(dq, copies[0], n), rel_diff(dk, copies[1], n),
                rel_diff(dv, copies[2], n));
    for (Element* c : copies) CHECK_CUDA(cudaFree(c));
  }
  std::fflush(stdout);
  for (void* x : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                  static_cast<void*>(dout), static_cast<void*>(out), static_cast<void*>(dq),
                  static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(lse),
                  static_cast<void*>(delta), static_cast<void*>(dq_accum),
                  static_cast<void*>(tile_counter)})
    CHECK_CUDA(cudaFree(x));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> dims{64, 128};
  std::vector<int64_t> seqlens{2048, 16384};
  std::vector<bool> causals{false, true};
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto list = [&](auto& v) {
      v.clear();
      while (i + 1 < argc && argv[i + 1][0] != '-') v.push_back(std::atoll(argv[++i]));
    };
    // The value after option a, which must be `first` or `second`: whether it is `second`.
    auto second_of = [&](const char* first, const char* second) {
      const std::string v = argv[++i];
      if (v != first && v != second) {
        std::fprintf(stderr, "%s: %s or %s, got %s\n", a.c_str(), first, second, v.c_str());
        std::exit(2);
      }
      return v == second;
    };
    if (a == "--dims") {
      list(dims);
    } else if (a == "--seqlens") {
      list(seqlens);
    } else if (a == "--causal" && i + 1 < argc) {
      const std::string c = argv[++i];
      causals = c == "no" ? std::vector<bool>{false}
                          : (c == "yes" ? std::vector<bool>{true} : std::vector<bool>{false, true});
    } else if (a == "--reps" && i + 1 < argc) {
      o.reps = std::atoi(argv[++i]);
    } else if (a == "--deterministic") {
      o.deterministic = true;
    } else if (a == "--layout" && i + 1 < argc) {
      o.bhsd = second_of("bshd", "bhsd");
    } else if (a == "--data" && i + 1 < argc) {
      g_normal = second_of("uniform", "normal");
    } else if (a == "--section" && i + 1 < argc) {
      o.section = std::atoi(argv[++i]);
    } else if (a == "--schedule" && i + 1 < argc) {
      o.schedule = second_of("static", "dynamic") ? 2 : 1;
    } else if (a == "--no-bwd") {
      o.bwd = false;
    } else if (a == "--fwd" && i + 1 < argc) {
      const std::string f = argv[++i];
#ifdef FLASH_ATTN_EXT_SM90
      o.sm90 = f == "sm90";
#endif
      if (f != "sm80" && !o.sm90) {
        std::fprintf(stderr, "--fwd: sm80, or sm90 in a build with the sm90 forward, got %s\n",
                     f.c_str());
        return 2;
      }
    } else if (a == "--tag" && i + 1 < argc) {
      o.tag = argv[++i];
    } else if (a == "--addresses") {
      o.addresses = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: %s, bf16, B*L = 16384, H*d = 2048, %s layout, %s forward%s\n",
              o.tag.c_str(), prop.name, o.bhsd ? "BHSD" : "BSHD", o.sm90 ? "sm90" : "sm80",
              o.deterministic ? ", deterministic backward" : "");
  for (int d : dims)
    for (int64_t seqlen : seqlens)
      for (bool causal : causals) {
        if (d == 64) {
          run_case<64>(seqlen, causal, o);
        } else if (d == 128) {
          run_case<128>(seqlen, causal, o);
        } else if (d == 256) {
          run_case<256>(seqlen, causal, o);
        } else {
          std::fprintf(stderr, "--dims: 64, 128 or 256, got %d\n", d);
          return 2;
        }
      }
  return 0;
}
