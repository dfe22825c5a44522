#!/usr/bin/env bash
# Small-batch decode GEMVs and launch fusion on one H200 (issue #19, deliverable 1), about 150 s; each stage
# has its own timeout and writes under $OUT. STAGES picks them (default: conformance bench suite):
#   conformance  gemv / gemv_rows (2..8 rows) / head_linear / mla_q_absorb / moe_gate (one launch, graph
#                replays) / norms (C 24 included) at real shapes and the kit's cases; fused-vs-unfused greedy
#                tokens (eager and CUDA graphs, batches 8..1);
#   bench        examples/gemv_bench.py: GB/s of weight at 1, 2, 4, 8 rows against the read ceiling and cuBLAS,
#                MLA's per-head products, the per-launch floor, the PDL chain, the gemv_rows tile sweep;
#   suite        V2-Lite decode b1 (CUDA graphs) with PROFILE=1: the kernel table and launches per layer
#                (DECODE_SUITE_ARGS adds options, e.g. --no-decode-fusion for the before);
#   suite_pdl    the same with DEEPINFER_PDL=1 (programmatic dependent launch of the decode GEMVs);
#   greedy_pdl   the fused-vs-unfused greedy test with DEEPINFER_PDL=1.
# Knobs: CONF_SEL (pytest -k of the conformance stage), CONF_CAP (its timeout, 60 s), BENCH_ARGS
# (gemv_bench.py options, "--sweep --no-kv-write"), CAP (timeout of each bench / suite stage, 45 s).
# Back: summary.txt and per stage a .log (conformance, gemv + gemv.json, suite.tar / suite_pdl.tar with
# results.json and the kernel tables).
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
py=python3
STAGES=${STAGES:-"conformance bench suite"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/summary.txt" 2>&1
SEL=${CONF_SEL:-"gemv or head_linear or moe_gate or mla_q_absorb or norms or (conformance_kit and (linear or moe_route or rms_norm)) or fused_and_unfused"}
BENCH_ARGS=${BENCH_ARGS:-"--sweep --no-kv-write"}
CAP=${CAP:-45}  # seconds per suite / bench stage

suite() {  # $1: name, then env assignments for the run
  local name=$1; shift
  mkdir -p "$OUT/$name"
  env "$@" PROFILE=1 timeout $CAP $py examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1 \
    --prefill-lens 1024 --no-transformers --no-eager $DECODE_SUITE_ARGS --out "$OUT/$name" 2>&1 | grep -v "INFO" > "$OUT/$name.log"
  echo "$name rc=${PIPESTATUS[0]}" >> "$OUT/summary.txt"
  rm -f "$OUT/$name"/*.trace.json.gz
  tar cf "$OUT/$name.tar" -C "$OUT" "$name" && rm -rf "$OUT/$name"
}

for stage in $STAGES; do
  t0=$(date +%s)
  case $stage in
    conformance)
      timeout ${CONF_CAP:-60} $py -m pytest -v -p no:cacheprovider -rfE -s tests/test_kernels_cuda_gpu.py \
        tests/test_decode_fusion_gpu.py -k "$SEL" > "$OUT/conformance.log" 2>&1
      echo "conformance rc=$?" >> "$OUT/summary.txt" ;;
    bench)
      timeout $CAP $py examples/gemv_bench.py $BENCH_ARGS --out "$OUT/gemv.json" 2>&1 | grep -v "INFO" > "$OUT/gemv.log"
      echo "gemv_bench rc=${PIPESTATUS[0]}" >> "$OUT/summary.txt" ;;
    suite) suite suite DEEPINFER_PDL=0 ;;
    suite_pdl) suite suite_pdl DEEPINFER_PDL=1 ;;
    greedy_pdl)
      DEEPINFER_PDL=1 timeout $CAP $py -m pytest -q -p no:cacheprovider -rfE -s tests/test_decode_fusion_gpu.py \
        -k fused_and_unfused > "$OUT/greedy_pdl.log" 2>&1
      echo "greedy_pdl rc=$?" >> "$OUT/summary.txt" ;;
  esac
  echo "  $stage: $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
done
# the compact summary (stdout)
cat "$OUT/summary.txt"
for f in conformance greedy_pdl; do
  [ -f "$OUT/$f.log" ] && grep -E "passed|failed|FAILED|ERROR|identical" "$OUT/$f.log" | grep -v "PASSED" | tail -12; [ -f "$OUT/$f.log" ] && echo "PASSED: $(grep -c PASSED "$OUT/$f.log")"
done
[ -f "$OUT/gemv.log" ] && cut -c1-170 "$OUT/gemv.log"
for name in suite suite_pdl; do
  [ -f "$OUT/$name.log" ] || continue
  echo "== $name"; grep -E "decode|ceilings" "$OUT/$name.log" | head -4
  tar xOf "$OUT/$name.tar" --wildcards "$name/*decode_b1*kernels.txt" 2>/dev/null | head -28 | cut -c1-110
done
