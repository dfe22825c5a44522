"""The perplexity baseline: held-out texts, the pinned CPU figures, and proof that a perturbed
kernel fails the check."""

import hashlib
import json
import re
import sys
import sysconfig
import zlib
from pathlib import Path

import pytest
import torch

import kernels_cpu.ops
from deepinfer_core.cli import main
from deepinfer_core.eval import ppl

ROOT = Path(__file__).resolve().parents[1]


def _provenance() -> list[tuple[str, str, int, str]]:
    """(file here, stdlib relative path, bytes, sha256 prefix) from PROVENANCE.md's table."""
    rows = re.findall(r"^\| `([^`]+)` \| `Lib/([^`]+)` \| (\d+) \| ([0-9a-f]{16}) \|$",
                      (ppl.HELDOUT_DIR / "PROVENANCE.md").read_text(), re.M)
    return [(a, b, int(c), d) for a, b, c, d in rows]


def test_heldout_texts_were_not_trained_on_and_carry_their_licence():
    modulus = int(re.search(r"^HELDOUT_MODULUS = (\d+)$", (ROOT / "examples" / "train_tiny.py").read_text(),
                            re.M).group(1))
    rows = _provenance()
    assert sorted(r[0] for r in rows) == sorted(name for name, _ in ppl.load_texts())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name, rel, size, sha in rows:
        data = (ppl.HELDOUT_DIR / name).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest()[:16] == sha
        assert zlib.crc32(rel.encode()) % modulus == 0, f"{rel} was in the training set"
        if sys.version_info[:3] == (3, 11, 7) and (stdlib / rel).is_file():
            assert (stdlib / rel).read_bytes() == data
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (ppl.HELDOUT_DIR / "LICENSE-PSF").read_text()


def test_greedy_comparison_allows_departures_only_at_near_ties():
    base = {"model": "m", "window": 8, "ppl": 10.0, "texts": {}, "continuations": [
        {"prompt": "p", "token_ids": [1, 2, 3, 4], "text": "abcd", "margins": [2.0, 0.1, 3.0, 3.0]}]}
    res = lambda ids: {"model": "m", "window": 8, "ppl": 10.0, "texts": {}, "continuations": [  # noqa: E731
        {"prompt": "p", "token_ids": ids, "text": "x", "margins": []}]}
    assert ppl.compare(base, res([1, 2, 3, 4])) == []
    assert ppl.compare(base, res([1, 9, 9, 9]), greedy_margin=0.5) == []  # departs at the 0.1 near-tie
    assert "departs from the baseline at token 1" in ppl.compare(base, res([1, 9, 9, 9]))[0]
    assert "at token 2" in ppl.compare(base, res([1, 2, 9, 4]), greedy_margin=0.5)[0]
    assert "at token 3" in ppl.compare(base, res([1, 2, 3]), greedy_margin=0.5)[0]  # stopped early
    assert "recorded for model m, this is other" in ppl.compare(base, dict(res([1, 2, 3, 4]), model="other"))[0]
    far = dict(res([1, 2, 3, 4]), ppl=10.002)
    assert "relative change 2.00e-04 > tolerance 1.0e-04" in ppl.compare(base, far)[0]


def test_perplexity_and_greedy_continuations_match_the_recorded_baseline(capsys):
    assert main(["eval", "ppl"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    baseline = json.loads(ppl.BASELINE.read_text())
    assert f"perplexity {baseline['ppl']:.6f} over {baseline['tokens']} tokens (float32, cpu)" in out
    assert out.rstrip().endswith("ok")


def test_a_perturbed_kernel_fails_the_check(monkeypatch, capsys):
    """RMSNorm off by one bfloat16 step (x (1 + 2^-7)): small enough to leave text plausible, and the
    check must still fail."""
    exact = kernels_cpu.ops.rms_norm
    monkeypatch.setattr(kernels_cpu.ops, "rms_norm", lambda x, w, eps: exact(x, w, eps) * (1 + 2 ** -7))
    assert main(["eval", "ppl"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: perplexity" in out and "> tolerance 1.0e-04" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the bf16 check of the nvidia kernels)")
def test_nvidia_bf16_perplexity_within_the_bf16_tolerance(capsys):
    assert main(["eval", "ppl", "--accelerator", "nvidia", "--dtype", "bfloat16"]) == 0, capsys.readouterr().out
