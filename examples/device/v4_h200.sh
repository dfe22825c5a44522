#!/usr/bin/env bash
# DeepSeek-V4 on one H200, in one device call (about 8 minutes at most; each stage has its own timeout and
# writes under $OUT, so a stage that fails or runs out of time leaves the others' results):
#   1. GPU conformance of the V4 TileLang kernels (tests/test_kernels_cuda_v4_gpu.py at V4-Flash shapes, and
#      the conformance kit's V4 cases of tests/test_kernels_cuda_gpu.py);
#   2. decode CUDA graphs vs eager on a random bf16 V4 (tests/test_v4_graphs.py, GPU test);
#   3. benchmark.py --suite h200 --shape v4-flash-slice -> $OUT/suite/results.json; with PROFILE=1 also the
#      kernel tables of decode b1 (graphs and eager, with launch counts) and b64 at 8k and of the 8k prefill,
#      concatenated in $OUT/suite/kernels.txt (their chrome traces go into $OUT/extras.tar).
# What comes back (7 files): summary.txt (GPU, stage times), conformance.log, graphs.log, suite.log,
# suite/results.json, suite/kernels.txt (PROFILE=1), extras.tar (junit XML, traces).
# Carry: .gpu/site_k.tar.xz .gpu/dist .gpu/tlcache.tar.xz (pack.sh; the cache holds the V4 kernels).
# Needs no embedded model weights.
#   run: bash examples/device/v4_h200.sh          (PROFILE=1 bash examples/device/v4_h200.sh: + kernel tables)
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/suite"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
py=python3
t0=$(date +%s)
timeout 165 $py -m pytest -q -p no:cacheprovider -rfE --junitxml="$OUT/conformance.xml" \
  tests/test_kernels_cuda_v4_gpu.py tests/test_kernels_cuda_gpu.py::test_conformance_kit \
  -k "v4 or mhc or clamped" > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
timeout 115 $py -m pytest -q -p no:cacheprovider -rfE --junitxml="$OUT/graphs.xml" \
  tests/test_v4_graphs.py::test_v4_graphs_match_eager_on_gpu > "$OUT/graphs.log" 2>&1
echo "graphs rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
t0=$(date +%s)
timeout 190 $py examples/benchmark.py --suite h200 --shape v4-flash-slice --out "$OUT/suite" > "$OUT/suite.log" 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
# at most 8 files come back: fold the small ones
cat "$OUT/gpu.txt" >> "$OUT/summary.txt" && rm -f "$OUT/gpu.txt"
if ls "$OUT"/suite/*.kernels.txt > /dev/null 2>&1; then
  for f in "$OUT"/suite/*.kernels.txt; do cat "$f"; echo; done > "$OUT/suite/kernels.txt"
  rm -f "$OUT"/suite/*.kernels.txt
fi
(cd "$OUT" && tar -cf extras.tar --remove-files ./*.xml $(ls suite/*.trace.json.gz 2>/dev/null)) || true
tail -n 15 "$OUT/conformance.log" "$OUT/graphs.log"
tail -n 25 "$OUT/suite.log"
[ -f "$OUT/suite/kernels.txt" ] && grep -A 14 "steps," "$OUT/suite/kernels.txt" | cut -c1-110
cat "$OUT/summary.txt"
