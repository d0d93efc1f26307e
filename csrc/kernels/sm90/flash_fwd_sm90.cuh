// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma tensor-core GEMMs, warp
// specialisation (FlashAttention-3, arXiv:2407.08608, sections 3.1-3.2), written with CuTe from
// the pinned nvidia-cutlass headers.  What each instantiation (flash_fwd_sm90_hdim*_*.cu)
// includes; the kernel lives in one header per role:
//
//   fwd_traits.h          tile shapes, warpgroups, register budgets, shared-memory layouts,
//                         TMA/wgmma types (Sm90FwdTraits); the kernel's arguments (Sm90FwdArgs)
//   fwd_tile_scheduler.h  tile order and static/dynamic schedule (tile_coord, next_tile), the
//                         producer-to-consumer tile handoff (TileInfo, Q buffer barriers)
//   fwd_producer.h        the producer warpgroup's TMA loads of Q, K, V; packed-GQA Q loads
//   fwd_mainloop.h        the consumers' Q K^T / P V wgmma loop, pingpong ring
//   fwd_softmax.h         online softmax (running max and sum, lazy rescaling of O)
//   fwd_mask.h            causal / window masking (csrc/mask.h's rule) per tile and per element
//   fwd_epilogue.h        O and LSE stores (TMA store, packed-GQA row stores, direct)
//   fwd_kernel.h          the __global__ function: set-up and role dispatch
//   fwd_launch_template.h host side: TMA descriptors, schedule choice, launch
//
// Plain attention, and a general variant with softcap and an additive bias (sm80::ScoreFn's rule,
// applied in fwd_mainloop.h); dropout goes to the sm80 kernel (csrc/kernel_select.h decides).
#pragma once

#ifndef NDEBUG
#define NDEBUG  // CUTLASS's pipelines otherwise add device-side role checks to every wait
#endif

#include "kernels/sm90/fwd_launch_template.h"
