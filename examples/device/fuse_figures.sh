#!/usr/bin/env bash
# Issue #19 figures on one H200: V2-Lite decode at b1/b64/b256 as % of the bandwidth roofline, and b64 against
# transformers eager and transformers with a static cache under torch.compile, two independent runs
# (each a fresh process: the engine is rebuilt, the ceilings re-measured; the second run's inductor compile
# hits the on-disk cache of the first). About 4 minutes in all. FUSE_RUNS="1" runs one; FUSE_TIMEOUT caps each.
# Back: summary.txt, run1.log, run2.log, run1.json, run2.json.
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
for i in ${FUSE_RUNS:-1 2}; do
  t0=$(date +%s)
  timeout ${FUSE_TIMEOUT:-230} python3 examples/benchmark.py --suite h200 --shape v2-lite --decode-batches 1,64,256 \
    --prefill-lens 1024 --hf-batches 64 --hf-compiled-batches 64 --no-eager --out "$OUT/run$i" 2>&1 \
    | grep -v "INFO" > "$OUT/run$i.log"; rc=${PIPESTATUS[0]}
  echo "run$i rc=$rc $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  cp "$OUT/run$i/results.json" "$OUT/run$i.json" 2>/dev/null; rm -rf "$OUT/run$i"
done
