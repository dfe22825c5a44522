#!/usr/bin/env bash
# Packs what a GPU machine without internet needs to run this repo into .gpu/ (git-ignored):
#   .gpu/site_k.tar.xz   tilelang + tvm-ffi + z3 + stevedore for Python 3.12 (the shared tool's pack,
#                        minus xgrammar, pydantic and z3's CLI so it fits one device call's 64 MiB)
#   .gpu/dist/           this package's dist-info (its entry points: backends and features)
#   .gpu/tlcache.tar.xz  every TileLang kernel the GPU tests and benchmarks use, compiled here
#                        without a GPU (examples/kernel_warm.py)
# Then each device call carries those four paths and starts with `source examples/device/setup.sh`.
# Tracked files plus that carry exceed one call's 64 MiB: a call that needs none of the big assets
# runs between `bash examples/device/slim.sh` and `bash examples/device/slim.sh restore`.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
mkdir -p .gpu
[ -f .gpu/site.tar.xz ] || bash ../shared/tools/gpu_site.sh
tmp=$(mktemp -d); tar xJf .gpu/site.tar.xz -C "$tmp"
rm -rf "$tmp"/pydantic* "$tmp"/xgrammar* "$tmp"/z3_solver-*.data
tar cJf .gpu/site_k.tar.xz -C "$tmp" . && rm -rf "$tmp"
rm -rf .gpu/dist && mkdir -p .gpu/dist
cp -r "$(python -c 'import importlib.metadata as m; print(m.distribution("deepinfer")._path)')" .gpu/dist/
rm -f .gpu/dist/*/RECORD .gpu/dist/*/direct_url.json
python examples/kernel_warm.py
ls -la .gpu
