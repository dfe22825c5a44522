#!/usr/bin/env bash
# Small-batch decode GEMVs and launch fusion on one H200 (issue #19, deliverable 1), about 150 s; each stage
# has its own timeout and writes under $OUT:
#   1. conformance: gemv / gemv_rows (2..8 rows) / head_linear / mla_q_absorb / moe_gate (one launch, graph
#      replays) / norms (C 24 included) at real shapes and the kit's cases; fused-vs-unfused greedy tokens
#      (eager and CUDA graphs, batches 8..1);
#   2. examples/gemv_bench.py: GB/s of weight at 1, 2, 4, 8 rows against the read ceiling and cuBLAS, MLA's
#      per-head products, the per-launch floor, gemv_rows tile sweep;
#   3. V2-Lite decode b1 (CUDA graphs) with PROFILE=1: the kernel table and launches per layer
#      (DECODE_SUITE_ARGS adds options, e.g. --no-decode-fusion for the before).
# Back: summary.txt, conformance.log, gemv.log, gemv.json, suite.log, suite.tar (results.json, kernels.txt).
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
py=python3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/summary.txt" 2>&1
t0=$(date +%s)
timeout 60 $py -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_cuda_gpu.py tests/test_decode_fusion_gpu.py \
  -k "gemv or head_linear or moe_gate or mla_q_absorb or norms or (conformance_kit and (linear or moe_route or rms_norm)) or fused_and_unfused" \
  > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
timeout 45 $py examples/gemv_bench.py --sweep --no-kv-write --out "$OUT/gemv.json" 2>&1 | grep -v "INFO" > "$OUT/gemv.log"
echo "gemv_bench rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
mkdir -p "$OUT/suite"
PROFILE=1 timeout 45 $py examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1 --prefill-lens 1024 \
  --no-transformers --no-eager $DECODE_SUITE_ARGS --out "$OUT/suite" 2>&1 | grep -v "INFO" > "$OUT/suite.log"
echo "suite rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
rm -f "$OUT"/suite/*.trace.json.gz
tar cf "$OUT/suite.tar" -C "$OUT" suite && rm -rf "$OUT/suite"
# the compact summary (stdout)
cat "$OUT/summary.txt"
grep -E "passed|failed|^FAILED|^ERROR|identical" "$OUT/conformance.log" | tail -15
cat "$OUT/gemv.log" | cut -c1-170
grep -E "decode|launches|ceilings" "$OUT/suite.log" | head -8
tar xOf "$OUT/suite.tar" --wildcards "suite/*decode_b1*kernels.txt" 2>/dev/null | head -32 | cut -c1-110
