#!/usr/bin/env bash
# FP8 latent KV cache on one H200 (issue 19, deliverable 3), in one device call of about 3 minutes; each
# stage has its own timeout and writes under $OUT:
#   1. (CONFORMANCE=1 only) tests/test_kv_fp8_gpu.py and the kit's paged_kv_write / mla_decode cases;
#   2. examples/kv_fp8_capacity.py --shape v2-lite --context 32768: max batch of 32k-token requests with
#      kv_cache_dtype bf16 and fp8 (two engines each, the whole 27-layer model with random bf16 weights),
#      and decode tok/s at that batch (two timed windows each, on a 2-layer slice holding exactly it).
# What comes back: summary.txt, gpu.txt, capacity.log, capacity.json (+ conformance logs with CONFORMANCE=1).
# Carry: .gpu/site_k.tar.xz .gpu/dist .gpu/tlcache.tar.xz (with the FP8 KV kernels of branch fp8kv's tlcache).
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [ "${CONFORMANCE:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kv_fp8_gpu.py > "$OUT/kv_fp8_gpu.log" 2>&1
  echo "kv_fp8_gpu rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  t0=$(date +%s)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_cuda_gpu.py \
    -k "paged_kv_write or mla_decode" > "$OUT/kit_mla.log" 2>&1
  echo "kit_mla rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
fi
t0=$(date +%s)
timeout 240 python3 examples/kv_fp8_capacity.py --shape v2-lite --context 32768 --runs 2 --decode-layers 2 \
  --json "$OUT/capacity.json" > "$OUT/capacity.log" 2>&1
echo "capacity rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -v Warning "$OUT/capacity.log" | tail -12
