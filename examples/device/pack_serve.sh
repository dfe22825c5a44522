#!/usr/bin/env bash
# Downloads into .gpu/serve_whl/ (git-ignored) the wheels `deepinfer serve` and `deepinfer bench serve`
# need on the GPU image, which has Python 3.12, torch, triton, transformers and huggingface_hub
# but no HTTP stack: fastapi, starlette, uvicorn, pydantic(+core), openai, httpx, prometheus_client and
# everything they require, and jinja2 (chat templates) in case the image lacks it. The set is the
# dependency closure of those five in this venv (markers evaluated for CPython 3.12 on Linux), each
# pinned to the version installed here; the binary ones (pydantic-core, jiter, markupsafe) come as
# cp312 manylinux wheels. About 7 MiB. On the device (see examples/device/serve_h200.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/serve_whl/*.whl
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
py=${PYTHON:-.venv/bin/python}
rm -rf .gpu/serve_whl && mkdir -p .gpu/serve_whl
pins=$("$py" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement

env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "platform_python_implementation": "CPython",
       "implementation_name": "cpython", "os_name": "posix", "extra": ""}
seen, todo = {}, ["fastapi", "uvicorn", "prometheus_client", "openai", "jinja2"]
while todo:
    dist = md.distribution(todo.pop())
    name = dist.metadata["Name"]
    if name.lower() in seen:
        continue
    seen[name.lower()] = f"{name}=={dist.version}"
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
print("\n".join(sorted(seen.values())))
EOF
)
for pin in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/serve_whl "$pin"
done
ls -la .gpu/serve_whl
du -sh .gpu/serve_whl
