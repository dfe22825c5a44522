#!/usr/bin/env bash
# docs/h200/s10: one device call (after `source examples/device/setup.sh`): V2-Lite with FP8 weights twice and bf16
# once, the decode FP8 kernels' GPU conformance, their microbenchmark, and PROFILE=1 kernel tables of the FP8 b1
# step before (DEEPINFER_FP8_GEMV=0: the GEMM paths; S10_BEFORE=0 skips it) and after. Everything lands in $OUT
# (s10.log: the output). S10_M: the microbenchmark's row counts (default 1,2,8); S10_SWEEP= skips its sweep.
set -u
export PYTHONUNBUFFERED=1
S="python3 examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1,64 --no-transformers --no-eager"
log=$OUT/s10.log
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  for r in 1 2; do
    timeout 120 $S --weight-dtype fp8 --out /tmp/fp8_run$r && cp /tmp/fp8_run$r/results.json $OUT/fp8_run$r.json
  done
  timeout 120 $S --weight-dtype bf16 --out /tmp/bf16 && cp /tmp/bf16/results.json $OUT/bf16_run1.json
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv_gpu.py 2>&1 | tail -40
  timeout 180 python3 examples/fp8_gemv_bench.py --out $OUT/fp8_gemv.json --m ${S10_M:-1,2,8} ${S10_SWEEP---sweep}
  if [ "${S10_BEFORE:-1}" = 1 ]; then
    PROFILE=1 DEEPINFER_FP8_GEMV=0 timeout 90 $S --weight-dtype fp8 --decode-batches 1 --out /tmp/prof_before
    cp /tmp/prof_before/decode_b1.kernels.txt $OUT/fp8_b1_before.kernels.txt
  fi
  PROFILE=1 timeout 90 $S --weight-dtype fp8 --decode-batches 1 --out /tmp/prof_after
  cp /tmp/prof_after/decode_b1.kernels.txt $OUT/fp8_b1_after.kernels.txt
} > $log 2>&1
grep -E "passed|failed|M=1:|moe |decode|FAILED|Error" $log | tail -60
