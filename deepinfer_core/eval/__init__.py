"""Offline evaluation: ``deepinfer eval generate | judge | report | ppl``.

Generation and judging are separate stages joined by a generations JSONL, so a new judge
re-scores old generations without re-generating. See ``deepinfer_core/eval/README.md``.
"""
