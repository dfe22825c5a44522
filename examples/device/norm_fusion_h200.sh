#!/usr/bin/env bash
# Batch-1 decode launch fusion on one H200 (issue #19): the norms in the GEMV / router prologues
# (add_rms_norm_linear, add_rms_norm_moe_gate) and the cache write in the decode query's launch
# (mla_q_absorb_kv_write). About 150 s; each stage has its own timeout and writes under $OUT.
# STAGES (default: conformance before after):
#   conformance  the fused ops at real shapes (tests/test_decode_fusion_ops_gpu.py), the kit's cases of the new ops;
#   greedy       the fused-vs-unfused greedy test on the random tiny V2-Lite (eager and CUDA graphs);
#   before       V2-Lite decode b1 (CUDA graphs, PROFILE=1) with DEEPINFER_NORM_GEMV=0 DEEPINFER_KV_FUSION=0
#                (the fused ops run as their separate launches: this branch's before);
#   after        the same with the fusions on;
#   bench        examples/gemv_bench.py --shapes v2-lite --m 1 (norm + GEMV fused against two launches).
# Back: summary.txt, conformance.log, before.tar / after.tar (results.json, kernel tables), gemv.log/json.
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
py=python3
STAGES=${STAGES:-"conformance greedy before after"}
CAP=${CAP:-45}
SEL=${CONF_SEL:-"norm or absorb_kv or (conformance_kit and (add_rms_norm or moe_gate or mla_q_absorb or mla_kv_write))"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/summary.txt" 2>&1

suite() {  # $1: name, then env assignments
  local name=$1; shift
  mkdir -p "$OUT/$name"
  env "$@" PROFILE=1 timeout $CAP $py examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1 \
    --prefill-lens 1024 --no-transformers --no-eager --out "$OUT/$name" 2>&1 | grep -v "INFO" > "$OUT/$name.log"
  echo "$name rc=${PIPESTATUS[0]}" >> "$OUT/summary.txt"
  rm -f "$OUT/$name"/*.trace.json.gz
  cp "$OUT/$name.log" "$OUT/$name/" 2>/dev/null
  tar cf "$OUT/$name.tar" -C "$OUT" "$name" && rm -rf "$OUT/$name" "$OUT/$name.log"
}

for stage in $STAGES; do
  t0=$(date +%s)
  case $stage in
    conformance)
      timeout ${CONF_CAP:-60} $py -m pytest -v -p no:cacheprovider -rfE -s tests/test_decode_fusion_ops_gpu.py \
        tests/test_kernels_cuda_gpu.py -k "$SEL" > "$OUT/conformance.log" 2>&1
      echo "conformance rc=$?" >> "$OUT/summary.txt" ;;
    greedy)  # its own pytest call: a collection error elsewhere must not stop the conformance above
      timeout ${CONF_CAP:-60} $py -m pytest -v -p no:cacheprovider -rfE -s tests/test_decode_fusion_gpu.py \
        -k greedy_agree_random > "$OUT/greedy.log" 2>&1
      echo "greedy rc=$?" >> "$OUT/summary.txt" ;;
    before) suite before DEEPINFER_NORM_GEMV=0 DEEPINFER_KV_FUSION=0 ;;
    after) suite after DEEPINFER_NORM_GEMV=1 DEEPINFER_KV_FUSION=1 ;;
    bench)
      timeout $CAP $py examples/gemv_bench.py --shapes ${BENCH_SHAPES:-v2-lite} --m 1 --no-kv-write ${BENCH_ARGS:-} \
        --out "$OUT/gemv.json" 2>&1 | grep -v "INFO" > "$OUT/gemv.log"
      echo "gemv_bench rc=${PIPESTATUS[0]}" >> "$OUT/summary.txt" ;;
  esac
  echo "  $stage: $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
for f in conformance greedy; do
  [ -f "$OUT/$f.log" ] || continue
  grep -E "passed|failed|FAILED|ERROR|identical" "$OUT/$f.log" | grep -v "PASSED" | tail -14
  echo "$f PASSED: $(grep -c PASSED "$OUT/$f.log")"
done
[ -f "$OUT/gemv.log" ] && cut -c1-170 "$OUT/gemv.log"
for name in before after; do
  [ -f "$OUT/$name.tar" ] || continue
  echo "== $name"; tar xOf "$OUT/$name.tar" "$name/$name.log" 2>/dev/null | grep -E "decode|ceilings" | head -4
  tar xOf "$OUT/$name.tar" --wildcards "$name/*decode_b1*kernels.txt" 2>/dev/null | head -16 | cut -c1-100
done
