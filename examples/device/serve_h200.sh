#!/usr/bin/env bash
# `deepinfer serve` on a random-weight DeepSeek-V2-Lite, loaded by `deepinfer bench serve` against
# LLM-style offline runs of the same prompts (the issue-15 H200 figure). Run from the repo root after
#   source examples/device/setup.sh
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/serve_whl/*.whl
# (wheels: examples/device/pack_serve.sh). Writes server.log, bench.log and serve_bench.json to $OUT.
# Only config.json and the embedded tokenizer are written; both engines build their weights with
# load_format="random", so no safetensors travel. The server's engine and the bench's offline engine
# share the GPU: each gets a fixed KV pool (KV_BYTES) instead of a share of the free memory.
#   SCALE=tiny DTYPE=float32 KV_BYTES=67108864 CONC=1,4 REPEATS=1 OUT=/tmp/o bash examples/device/serve_h200.sh
#                                                                     # the same on a CPU, in a minute
set -euo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/serve_out}
SCALE=${SCALE:-full}
DTYPE=${DTYPE:-bfloat16}
KV_BYTES=${KV_BYTES:-8589934592}          # 8 GiB: 276k tokens of V2-Lite KV per engine
CONC=${CONC:-1,16,64}
REPEATS=${REPEATS:-3}
PORT=${PORT:-8765}
CKPT=/tmp/v2lite-$SCALE
mkdir -p "$OUT"

"$PY" - "$CKPT" "$SCALE" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "examples")
from random_checkpoint import shape_config, write_config

out, scale = Path(sys.argv[1]), sys.argv[2]
cfg = shape_config("v2-lite")
if scale == "tiny":  # h200_suite.TINY (every width shrunk), with the embedded tokenizer's vocabulary
    cfg.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=4096,
               max_position_embeddings=1024)
write_config(out, cfg)
assert (out / "tokenizer.json").is_file(), "the embedded tokenizer did not fit this vocabulary"
print(f"wrote {out} ({scale})")
EOF

OPTS=(-o 'load_format="random"' -o "dtype=\"$DTYPE\"" -o "kv_cache_memory=$KV_BYTES" -o max_num_seqs=64
      -o max_model_len=1024)
"$PY" -m deepinfer_core.cli serve "$CKPT" --port "$PORT" --max-queue-len 4096 "${OPTS[@]}" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 480); do
  kill -0 $SERVER 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/server.log"; exit 1; }
  "$PY" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    2>/dev/null && break
  sleep 0.5
done
echo "server healthy after ${SECONDS}s"
"$PY" -m deepinfer_core.cli bench serve --base-url "http://127.0.0.1:$PORT/v1" --model "$CKPT" "${OPTS[@]}" \
  --concurrency "$CONC" --input-len 64 --output-len 64 --repeats "$REPEATS" --compare-offline \
  --json "$OUT/serve_bench.json" 2>&1 | tee "$OUT/bench.log"
echo "done after ${SECONDS}s"
