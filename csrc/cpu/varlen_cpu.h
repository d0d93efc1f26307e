// Packed sequences on the CPU kernels: the geometry (Seqs, flash_cpu.h) the forward and
// backward kernels read, from the checked call (varlen_checks.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/flash_cpu.h"
#include "varlen_checks.h"

namespace flash_attn_ext::cpu {

// The CPU kernels' view of a packed call's sequences (host offsets).
inline Seqs host_seqs(const Packed& pk) {
  Seqs s;
  s.cu_q = pk.cu_q_host.data_ptr<int32_t>();
  s.cu_k = pk.cu_k_host.data_ptr<int32_t>();
  s.used_k = pk.used_k_host.defined() ? pk.used_k_host.data_ptr<int32_t>() : nullptr;
  s.total_q = pk.total_q;
  return s;
}

// make_packed's longest lengths (max_seqlen_q / max_seqlen_k: at least the longest sequence,
// and FlashAttention-2 code often passes a model's maximum length instead) cut to the longest
// sequence of the host offsets: the kernels count tiles and tasks from them, so that a
// max_seqlen near 2^63 made those counts overflow (zeros from the forward, wrong dq / dk from
// the backward) and one of 1e10 ran the task loop for seconds (a new-user finding).
inline void clamp_to_longest(FwdParams& p, const Packed& pk) {
  const int32_t* cu[2] = {pk.cu_q_host.data_ptr<int32_t>(), pk.cu_k_host.data_ptr<int32_t>()};
  int64_t longest[2] = {0, 0};
  for (int i = 0; i < 2; ++i)
    for (int64_t b = 0; b < pk.batch; ++b)
      longest[i] = std::max<int64_t>(longest[i], cu[i][b + 1] - cu[i][b]);
  p.seqlen_q = std::min(p.seqlen_q, longest[0]);
  p.seqlen_k = std::min(p.seqlen_k, longest[1]);
}

}  // namespace flash_attn_ext::cpu
