// C = alpha * op(A) @ op(B) + beta * C on row-major tiles in raw CPU memory, through ATen's BLAS
// (MKL/OpenBLAS via at::addmm_out), so the tiles of the FlashAttention loops run at GEMM speed.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "cpu/fp16_convert.h"

namespace flash_attn_ext::cpu {

// A row-major matrix view: element (r, c) at data[r * ld + c]; `transposed` reads it as its
// transpose (element (r, c) of the view at data[c * ld + r]).
template <typename T>
struct Mat {
  const T* data;
  int64_t ld;
  bool transposed = false;
  Mat t() const { return {data, ld, !transposed}; }
};

// Wraps (rows x cols) of `m` as a tensor without copying.
template <typename T>
inline at::Tensor as_tensor(const Mat<T>& m, int64_t rows, int64_t cols) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  auto* ptr = const_cast<T*>(m.data);
  if (m.transposed) return at::from_blob(ptr, {rows, cols}, {1, m.ld}, at::dtype(dtype));
  return at::from_blob(ptr, {rows, cols}, {m.ld, 1}, at::dtype(dtype));
}

// C (m x n, leading dimension ldc) = alpha * A (m x k) @ B (k x n) + beta * C.
// With beta == 0, C's previous contents are ignored (BLAS semantics; NaN there does not leak).
template <typename T>
inline void gemm(T* c, int64_t ldc, const Mat<T>& a, const Mat<T>& b, int64_t m, int64_t n,
                 int64_t k, double alpha, double beta) {
  if (m == 0 || n == 0) return;
  at::Tensor ct = as_tensor(Mat<T>{c, ldc}, m, n);
  if (k == 0) {
    ct.mul_(beta);
    return;
  }
  at::addmm_out(ct, ct, as_tensor(a, m, k), as_tensor(b, k, n), beta, alpha);
}

// Copies a (rows x cols) tile with source leading dimension `ld` into dense `dst` (ld = cols),
// converting to the accumulator type T.
template <typename T, typename S>
inline void load_tile(T* dst, const S* src, int64_t rows, int64_t cols, int64_t ld) {
  if constexpr (std::is_same_v<S, c10::Half> && std::is_same_v<T, float>) {
    if (fp16::f16c()) {
      for (int64_t r = 0; r < rows; ++r)
        fp16::half_to_float(dst + r * cols, reinterpret_cast<const uint16_t*>(src + r * ld),
                            cols);
      return;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * ld;
    T* d = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<T>(s[c]);
  }
}

// A (rows x cols) tile at `src` (leading dimension ld) as an accumulator-type matrix: read in
// place when the types match (fp32, fp64), else converted into `buf` (fp16, bf16).
template <typename T, typename S>
inline Mat<T> acc_view(const S* src, int64_t rows, int64_t cols, int64_t ld, T* buf) {
  if constexpr (std::is_same_v<S, T>) {
    return {src, ld};
  } else {
    load_tile(buf, src, rows, cols, ld);
    return {buf, cols};
  }
}

}  // namespace flash_attn_ext::cpu
