#!/usr/bin/env bash
# Decode fusion on one H200 in one device call (about 3 minutes; each stage has its own timeout):
#   1. conformance of the new kernels (gemv / linear_f32 / mla_kv_write: kit cases and real shapes) and the
#      fused-vs-unfused greedy agreement on the embedded model (eager and graphs);
#   2. examples/gemv_bench.py: small-M projections GB/s against the read ceiling and cuBLAS, mla_kv_write
#      against its unfused ops;
#   3. benchmark.py --suite h200 --shape v2-lite, decode b1 and b64 only, PROFILE=1 kernel tables with
#      launches per layer (FUSE_SUITE_ARGS adds options, e.g. --no-decode-fusion for the before).
# Back: summary.txt, conformance.log, gemv.log, gemv.json, suite.log, suite.tar (results.json, kernels.txt).
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
py=python3
t0=$(date +%s)
timeout 170 $py -m pytest -q -p no:cacheprovider -rfE -s tests/test_kernels_cuda_gpu.py tests/test_decode_fusion_gpu.py \
  -k "gemv or mla_kv_write or (conformance_kit and linear) or fused_and_unfused" > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
timeout 120 $py examples/gemv_bench.py --out "$OUT/gemv.json" 2>&1 | grep -v "INFO" > "$OUT/gemv.log"; rc=${PIPESTATUS[0]}
echo "gemv_bench rc=$rc $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
mkdir -p "$OUT/suite"
PROFILE=1 timeout 200 $py examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1,64 \
  --prefill-lens 1024 --no-transformers --no-eager $FUSE_SUITE_ARGS --out "$OUT/suite" 2>&1 | grep -v "INFO" > "$OUT/suite.log"; rc=${PIPESTATUS[0]}
echo "suite rc=$rc $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
rm -f "$OUT"/suite/*.trace.json.gz
tar cf "$OUT/suite.tar" -C "$OUT" suite && rm -rf "$OUT/suite"
