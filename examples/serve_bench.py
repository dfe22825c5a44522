"""``deepinfer bench serve`` on a random-weight shape (``random_checkpoint.SHAPES``), e.g. the H200 run:

    python examples/serve_bench.py --shape v2-lite --concurrency 1,16,64 --compare-offline \\
        -o 'dtype="bfloat16"' -o kv_cache_memory=0.4 --input-len 512 --output-len 256

Only config.json and the tokenizer are written; both the server and the offline engine build seeded
random weights (``load_format="random"``). Two engines share the device, so give each a share of
its memory with ``kv_cache_memory``. Every other argument goes to ``deepinfer bench serve``
(``deepinfer_core/serving/bench.py``); without ``--shape`` this is that command.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import SHAPES, shape_config, write_config  # noqa: E402

from deepinfer_core.serving import bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    args, rest = ap.parse_known_args()
    if args.shape is None:
        return bench.main(["serve", *rest])
    with tempfile.TemporaryDirectory() as tmp:
        model = write_config(Path(tmp) / args.shape, shape_config(args.shape))
        return bench.main(["serve", "--model", str(model), "-o", 'load_format="random"', *rest])


if __name__ == "__main__":
    sys.exit(main())
