#!/usr/bin/env bash
# Every GPU test file in one device call (after `bash examples/device/slim.sh`, carrying .gpu/site_k.tar.xz
# .gpu/dist .gpu/tlcache.tar.xz): the kernels the tests build are compiled first, JOBS dry runs at a time
# (DEEPINFER_TL_DRYRUN=1, CUDA hidden: each compiles its share of the test ids into a cache of its own, seeded
# from the carried one; the caches are then merged), then the tests run on the GPU from the merged cache. A
# packed cache holds the engine's kernels, not all of the tests' (a plain run spent its 420 s compiling).
#   FILES     test files (default: tests/*_gpu.py but test_cuda_graphs_gpu.py, which needs the embedded model's
#             weights that slim.sh leaves out)
#   JOBS      parallel compile runs (default 8)
#   WARM_CAP  seconds for the compile phase (default 240); CAP seconds for the run (default 300)
# Writes $OUT/summary.txt, $OUT/gpu_tests.log and $OUT/warm_failures.log (what a dry run could not build).
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
files=${FILES:-$(ls tests/*_gpu.py | grep -v test_cuda_graphs_gpu)}
sum="$OUT/summary.txt"
run_ids='import sys, pytest; sys.exit(pytest.main(["-q", "-p", "no:cacheprovider"] + open(sys.argv[1]).read().splitlines()))'
t0=$(date +%s)
DEEPINFER_TL_DRYRUN=1 CUDA_VISIBLE_DEVICES= python3 -m pytest --collect-only -q -p no:cacheprovider $files 2>/dev/null \
  | grep '::' > /tmp/ids.txt
split -n r/${JOBS:-8} /tmp/ids.txt /tmp/ids_
for f in /tmp/ids_??; do
  mkdir -p "$f.tlc" && cp -r "$TILELANG_CACHE_DIR"/. "$f.tlc"/
  (TILELANG_CACHE_DIR="$f.tlc" DEEPINFER_TL_DRYRUN=1 CUDA_VISIBLE_DEVICES= timeout ${WARM_CAP:-240} \
     python3 -c "$run_ids" "$f" > "$f.log" 2>&1) &
done
wait
for f in /tmp/ids_??; do
  cp -rn "$f.tlc"/. "$TILELANG_CACHE_DIR"/
  grep -E "^(FAILED|ERROR)" "$f.log" >> "$OUT/warm_failures.log"
done
echo "warm: $(wc -l < /tmp/ids.txt) test ids in ${JOBS:-8} dry runs, $(( $(date +%s) - t0 )) s" >> "$sum"
t1=$(date +%s)
timeout ${CAP:-300} python3 -m pytest -q -p no:cacheprovider -rfE $files > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$OUT/gpu_tests.log") $(( $(date +%s) - t1 )) s" >> "$sum"
cat "$sum"
