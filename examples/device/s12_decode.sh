#!/usr/bin/env bash
# Issue #19, twelfth session: one device call (after `bash examples/device/slim.sh`, carrying .gpu/site_k.tar.xz
# .gpu/dist .gpu/tlcache.tar.xz). Each stage has its own timeout and writes under $OUT; what comes back is at most
# summary.txt, conf.log, micro.tar and suites.tar.
#   STAGES   (default "conf micro suites")
#   CONF     ";"-separated pytest arguments (files and -k), one pytest run each, all into conf.log
#   MICRO    ";"-separated commands of the microbenchmark stage (each line's output goes to micro/NAME.log,
#            NAME its first word after "python3 examples/"); their --out files land in micro/ too ($M)
#   SUITES   ";"-separated "name|batches|weight dtype|env assignments|extra args": one
#            `benchmark.py --suite h200 --shape v2-lite` run each (PROFILE=1 in env writes kernel tables; extra args
#            replace --no-transformers, e.g. "--hf-batches 64 --hf-compiled-batches 64")
#   CAP      seconds per suite run (default 90)
source examples/device/setup.sh
export PYTHONUNBUFFERED=1
py=python3
sum="$OUT/summary.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >> "$sum" 2>&1
M=/tmp/micro; S=/tmp/suites; mkdir -p $M $S
export M

for stage in ${STAGES:-conf micro suites}; do
  t0=$(date +%s)
  case $stage in
    conf)
      IFS=';' read -ra sets <<< "$CONF"
      for c in "${sets[@]}"; do
        echo "=== $c" >> "$OUT/conf.log"
        eval timeout ${CONF_CAP:-150} $py -m pytest -q -p no:cacheprovider -rfE $c >> "$OUT/conf.log" 2>&1
        echo "conf [$c] rc=$? $(tail -1 "$OUT/conf.log")" >> "$sum"
      done ;;
    micro)
      IFS=';' read -ra cmds <<< "$MICRO"
      for c in "${cmds[@]}"; do
        name=$(echo "$c" | sed -E 's/.*examples\/([a-z0-9_]+)\.py.*/\1/')_$(date +%s)
        eval timeout ${MICRO_CAP:-120} $c > "$M/$name.log" 2>&1
        echo "micro $name rc=$? $(( $(date +%s) - t0 )) s" >> "$sum"
      done ;;
    suites)
      IFS=';' read -ra runs <<< "$SUITES"
      for r in "${runs[@]}"; do
        IFS='|' read -r name batches wdt envs extra <<< "$r"
        t1=$(date +%s)
        env $envs timeout ${CAP:-90} $py examples/benchmark.py --suite h200 --shape v2-lite --decode-batches "$batches" \
          --weight-dtype "$wdt" --prefill-lens 1024 --no-eager ${extra:---no-transformers} --out "$S/$name" 2>&1 \
          | grep -v INFO > "$S/$name.log"
        rc=${PIPESTATUS[0]}
        rm -f "$S/$name"/*.trace.json.gz
        line=$($py - "$S/$name/results.json" <<'EOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
print(" ".join(f"b{r['batch']} {r['step_ms']:.3f}ms {100 * r['fraction']:.1f}%" for r in d["decode"]))
EOF
)
        echo "suite $name rc=$rc $(( $(date +%s) - t1 )) s: $line" >> "$sum"
      done ;;
  esac
  echo "stage $stage $(( $(date +%s) - t0 )) s" >> "$sum"
  tar cf "$OUT/micro.tar" -C /tmp micro 2>/dev/null  # after every stage: a call cut off keeps what it has
  tar cf "$OUT/suites.tar" -C /tmp suites 2>/dev/null
done
cat "$sum"
