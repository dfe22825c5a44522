#!/usr/bin/env bash
# A device call copies the tracked files plus what it carries, 64 MiB at most. The tracked assets
# (about 43 MB: the embedded model, tiny V4, the draft model) and pack.sh's carry (about 50 MB) no
# longer fit together. For a call that needs none of the big assets (a random --shape checkpoint,
# kernel tests), this takes them out of the index and ignores them locally; the files stay on disk.
#
#   bash examples/device/slim.sh          # before the device call(s)
#   bash examples/device/slim.sh restore  # after: the index and .git/info/exclude as they were
#
# The embedded model's tokenizer stays (random checkpoints copy it). Commit nothing in between.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
paths=(deepinfer_core/assets/tiny_v4 deepinfer_core/assets/default_draft
       deepinfer_core/assets/default_model/model-00001-of-00002.safetensors
       deepinfer_core/assets/default_model/model-00002-of-00002.safetensors)
exclude=.git/info/exclude
begin="# examples/device/slim.sh: begin" end="# examples/device/slim.sh: end"
if [ "${1:-}" = restore ]; then
  git reset -q -- "${paths[@]}"
  [ -f "$exclude" ] && sed -i "\|^$begin\$|,\|^$end\$|d" "$exclude"
else
  git rm -r -q --cached -- "${paths[@]}"
  { echo "$begin"; for p in "${paths[@]}"; do echo "/$p"; done; echo "$end"; } >> "$exclude"
fi
git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | sed 's/total/bytes tracked/'
