#!/usr/bin/env bash
# One device call for branch sm90-persistent: build, the Hopper tests and compute-sanitizer under
# each FLASH_ATTN_EXT_SM90_SCHEDULE (dynamic, static, tile = one CTA per tile as on main), then the
# forward of the three schedules side by side (CUDA-graph timing, bench_attention's shapes).
# Usage on the GPU machine: OUT=... bash scripts/gpu_verify_persistent.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=16 \
  python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
echo "test_cuda (default schedule): $(timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rfE tests/test_cuda.py 2>&1 \
  | tee "$OUT/test_cuda.log" | tail -1)"
grep -E "^(FAILED|ERROR) " "$OUT/test_cuda.log" | head -20
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for s in dynamic static tile; do
  export FLASH_ATTN_EXT_SM90_SCHEDULE=$s
  echo "$s tests: $(timeout 120 python3 -m pytest -q tests/test_sm90.py 2>&1 | tail -1)"
  [ $s = tile ] && continue
  for tool in racecheck memcheck; do
    echo "$s $tool: $(timeout 90 "$SAN" --print-limit 5 --tool $tool python3 scripts/sanitize_cases.py \
      2>&1 | tee "$OUT/sanitize_${s}_$tool.log" | tail -1)"
  done
done
unset FLASH_ATTN_EXT_SM90_SCHEDULE
timeout 200 python3 - <<'PYEOF' 2>&1 | tee "$OUT/schedules.txt"
import os, sys
import torch
sys.path.insert(0, "benchmarks")
from bench_attention import graph_ms
import flash_attn_ext
print("forward TFLOP/s (CUDA-graph timing), bf16, B*L = 16k, H*d = 2048")
for d in (64, 128, 256):
    for L in (1024, 2048, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // L, 2048 // d
            q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
            flops = 4 * B * H * L * L * d / (2 if causal else 1)
            cells = []
            for s in ("tile", "static", "dynamic"):
                os.environ["FLASH_ATTN_EXT_SM90_SCHEDULE"] = s
                with torch.no_grad():
                    ms = graph_ms(lambda: flash_attn_ext.scaled_dot_product_attention(
                        q, k, v, is_causal=causal))
                cells.append(f"{s} {flops / ms / 1e9:6.1f}")
            print(f"d={d:3d} L={L:5d} causal={causal!s:5s} " + "  ".join(cells), flush=True)
PYEOF
