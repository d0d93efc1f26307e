// The masking rule, in one place, for every kernel.
//
// Key j is visible to query i when  i + off - window_left <= j <= i + off + window_right,
// where off = seqlen_k - seqlen_q (bottom-right alignment, FlashAttention >= 2.1) or 0 (top-left,
// torch.tril), and a window side of -1 is unbounded.  Causal is window_right = 0.
// Both bounds are non-decreasing in i, so a tile of rows [i0, i1) sees keys
// [begin(i0), end(i1 - 1)), and a tile of keys [j0, j1) is seen by a contiguous range of rows.
#pragma once

#include <cstdint>
#include <climits>

#if defined(__CUDACC__)
#define FAE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FAE_HOST_DEVICE inline
#endif

namespace flash_attn_ext {

struct VisibleKeys {
  int64_t offset, window_left, window_right, seqlen_k;

  FAE_HOST_DEVICE VisibleKeys(int64_t seqlen_q, int64_t seqlen_k_, int64_t window_left_,
                              int64_t window_right_, bool align_bottom_right)
      : offset(align_bottom_right ? seqlen_k_ - seqlen_q : 0),
        window_left(window_left_),
        window_right(window_right_),
        seqlen_k(seqlen_k_) {}

  FAE_HOST_DEVICE static int64_t clamp(int64_t x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : x);
  }
  // First visible key of query row i.
  FAE_HOST_DEVICE int64_t begin(int64_t i) const {
    return window_left < 0 ? 0 : clamp(i + offset - window_left, 0, seqlen_k);
  }
  // One past the last visible key of query row i (end <= begin means the row sees nothing).
  FAE_HOST_DEVICE int64_t end(int64_t i) const {
    return window_right < 0 ? seqlen_k : clamp(i + offset + window_right + 1, 0, seqlen_k);
  }
  FAE_HOST_DEVICE bool empty_row(int64_t i) const { return end(i) <= begin(i); }
  // What the query rows [m0, m0 + rows), cut at seqlen_q, see in key tiles of block_n keys:
  // tiles [n_begin, n_end) hold every key any of them sees (n_end = n_begin: none), and keys
  // [interior_begin, interior_end) are visible to every one of them (a key tile inside that
  // range needs no mask).  The kernels' per-block loop bounds.
  struct Block {
    int64_t n_begin, n_end, interior_begin, interior_end;
  };
  FAE_HOST_DEVICE Block block(int64_t m0, int64_t rows, int64_t seqlen_q,
                              int64_t block_n) const {
    const int64_t last_row = (m0 + rows < seqlen_q ? m0 + rows : seqlen_q) - 1;
    const int64_t key_begin = begin(m0), key_end = end(last_row);
    const int64_t n_begin = key_begin / block_n;
    return {n_begin, key_end > key_begin ? (key_end + block_n - 1) / block_n : n_begin,
            begin(last_row), end(m0)};
  }
  // The visible keys of rows row0 + dr relative to key0 and clipped to [0, limit], limit =
  // min(tile_keys, seqlen_k - key0): for a kernel's per-element mask of one tile, in 32-bit
  // (begin(dr) == clamp(begin(row0 + dr) - key0, 0, limit), end likewise; for key0 >= 0 and
  // 0 <= dr < 2^30).  The 64-bit row arithmetic is done once per tile, here.
  struct Relative {
    int begin0, end0, limit;
    bool left, right;  // window_left / window_right >= 0
    FAE_HOST_DEVICE int begin(int dr) const {
      const int x = begin0 + dr;
      return left ? (x < 0 ? 0 : (x > limit ? limit : x)) : 0;
    }
    FAE_HOST_DEVICE int end(int dr) const {
      const int x = end0 + dr;
      return right ? (x < 0 ? 0 : (x > limit ? limit : x)) : limit;
    }
    // The same test without clamps, for a thread whose elements lie at (key k0 + dk, row r0 +
    // dr) of the tile: key k0 + dk is hidden from row r0 + dr iff hidden(dk, dr), i.e. iff
    // (left && k - r < begin0) || (right && k - r >= end0) || k >= limit (for k >= 0, the
    // clamps of begin / end change nothing).  With dk and dr compile-time offsets that is
    // three comparisons with immediates and no branch per element.
    struct Thread {
      int lo, hi, k_limit;  // on k - r (offset by r0 - k0) and on dk
      FAE_HOST_DEVICE bool hidden(int dk, int dr) const {
        return dk - dr < lo || dk - dr >= hi || dk >= k_limit;
      }
    };
    FAE_HOST_DEVICE Thread thread(int k0, int r0) const {
      constexpr int kNever = 1 << 30;  // beyond every tile's k - r (begin0 / end0 are clamped)
      return {left ? begin0 - (k0 - r0) : -kNever, right ? end0 - (k0 - r0) : kNever,
              limit - k0};
    }
  };
  FAE_HOST_DEVICE Relative relative(int64_t row0, int64_t key0, int64_t tile_keys) const {
    constexpr int64_t kBig = int64_t{1} << 30;  // beyond every tile: clamping there is exact
    return {static_cast<int>(clamp(row0 + offset - window_left - key0, -kBig, kBig)),
            static_cast<int>(clamp(row0 + offset + window_right + 1 - key0, -kBig, kBig)),
            static_cast<int>(clamp(seqlen_k - key0, 0, tile_keys)), window_left >= 0,
            window_right >= 0};
  }
  // The query rows that can see a key in [j0, j1) (0 <= j0 < j1 <= seqlen_k) are
  // [first_row(j0), row_limit(j1)), the caller clamping both to [0, seqlen_q]:
  // first_row is the smallest i with end(i) > j0, row_limit the smallest i with begin(i) >= j1.
  FAE_HOST_DEVICE int64_t first_row(int64_t j0) const {
    return window_right < 0 ? INT64_MIN : j0 - offset - window_right;
  }
  FAE_HOST_DEVICE int64_t row_limit(int64_t j1) const {
    return window_left < 0 ? INT64_MAX : j1 - offset + window_left;
  }
};

}  // namespace flash_attn_ext
