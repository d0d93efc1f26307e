// Packed sequences on the CPU kernels: the geometry (Seqs, flash_cpu.h) the forward and
// backward kernels read, from the checked call (varlen_checks.h).
#pragma once

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

}  // namespace flash_attn_ext::cpu
