#!/usr/bin/env bash
# MLA decode kernels on one H200 (issue 19: split/combine at small batch, FP8 rows), one device call of
# about 2.5 minutes; each stage has its own timeout and writes under $OUT:
#   1. conformance: tests/test_kernels_cuda_gpu.py -k mla_decode (bf16: 16/32/128 heads, splits, contexts
#      1..40000, ragged), tests/test_kv_fp8_gpu.py (FP8 rows), tests/test_mla_decode_split.py;
#   2. examples/mla_decode_bench.py: attention time per layer at batch 1 and 8 (27 calls in a CUDA graph),
#      before (64-key splits + serial combine) / after / split-size sweep;
#   3. examples/kv_fp8_decode_bench.py: us per 1k keys, bf16 rows at batch 86 vs FP8 rows at 151, 32k context,
#      16 heads, then 128 (V3: the warp-specialised kernel, FP8 loader).
#   4. (STAGES=cap) examples/kv_fp8_capacity.py: max batch at 32k and decode tok/s at it, bf16 vs FP8 rows.
# STAGES (default "conf,b1,fp8"; also confws: only the ws FP8 cases) picks stages; *_TIMEOUT and B1_KEYS
# shorten them. What comes back: summary.txt and the logs/JSON of each stage.
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
STAGES=${STAGES:-conf,b1,fp8}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader > "$OUT/summary.txt" 2>&1
stage() { [[ ",$STAGES," == *",$1,"* ]]; }
# pytest FILES -k EXPR: one invocation per selection (a second -k would replace the first)
conf() {  # name timeout pytest-args...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/$name.log")" >> "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | cut -c1-200 >> "$OUT/summary.txt"
}
if stage conf; then
  conf conformance_bf16 60 tests/test_kernels_cuda_gpu.py -k mla_decode
  conf conformance_fp8 40 tests/test_kv_fp8_gpu.py tests/test_mla_decode_split.py -k "not V3 and not H128"
  # FP8 rows at V3's 128 heads (the warp-specialised kernel's FP8 loader): on its own, in case it hangs
  conf conformance_ws_fp8 40 tests/test_kv_fp8_gpu.py -k "V3 or H128 or ws"
fi
if stage confws; then  # the ws kernel (bf16 rows; FP8 loader: V3 heads, 16 heads padded) and f16 tiles for FP8 rows
  conf conformance_ws ${CONF_TIMEOUT:-45} tests/test_kernels_cuda_gpu.py tests/test_kv_fp8_gpu.py \
    -k "mla_decode and (V3 or warp or ws or f16 or H128)"
fi
if stage b1; then
  t0=$(date +%s)
  timeout ${B1_TIMEOUT:-35} python3 examples/mla_decode_bench.py --heads 16,128 --batches 1,8 --contexts 512,2048,8192 \
    --keys "${B1_KEYS-64,128,512,1024}" --json "$OUT/mla_small_batch.json" > "$OUT/mla_small_batch.log" 2>&1
  echo "mla_small_batch rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  python3 - "$OUT/mla_small_batch.log" >> "$OUT/summary.txt" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for key in sorted({(r["heads"], r["batch"], r["context"]) for r in rows}):
    got = {r["variant"]: r["us_per_layer"] for r in rows if (r["heads"], r["batch"], r["context"]) == key}
    print("H%d B%d ctx%d: " % key + "  ".join(f"{k} {v}" for k, v in got.items()))
EOF
fi
if stage fp8; then
  t0=$(date +%s)
  timeout ${FP8_TIMEOUT:-50} python3 examples/kv_fp8_decode_bench.py --heads 16,128 --reps 10 \
    --json "$OUT/fp8_per_key.json" > "$OUT/fp8_per_key.log" 2>&1
  echo "fp8_per_key rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  python3 - "$OUT/fp8_per_key.log" >> "$OUT/summary.txt" <<'EOF'
import json, sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        print(f"{r['kind']} H{r['heads']} B{r['batch']} {r['cfg']}: {r['us']:.0f} us, {r['us_per_1k_keys']:.3f} us/1k keys, "
              f"{r['kv_TBps']:.2f} TB/s")
EOF
fi
if stage cap; then  # decode tok/s at the 32k max batch, bf16 vs FP8 rows (docs/kv_fp8.md's run, ~2 minutes)
  t0=$(date +%s)
  # MAX_BATCH (e.g. bf16=86,fp8=151, docs/kv_fp8.md's capacity runs) skips the capacity runs: decode only
  timeout ${CAP_TIMEOUT:-170} python3 examples/kv_fp8_capacity.py --shape v2-lite --context 32768 --runs 2 --decode-layers 2 \
    ${MAX_BATCH:+--max-batch $MAX_BATCH} --json "$OUT/capacity.json" > "$OUT/capacity.log" 2>&1
  echo "capacity rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  grep -v Warning "$OUT/capacity.log" | grep '"decode_layers"' | cut -c1-400 >> "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
