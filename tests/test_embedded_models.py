"""Embedded checkpoints by name (``models.loader.EMBEDDED_MODELS``): ``LLM(model="tiny-v4")`` loads the
shipped tiny DeepSeek-V4 and its greedy output equals transformers' ``DeepseekV4ForCausalLM`` in
float32 on the same files; an unknown name is one clear error listing the known names."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.loader import EMBEDDED_MODEL, EMBEDDED_MODELS, CheckpointError, resolve_model_dir

PROMPT = "    for i, line in enumerate("  # greedy gives varied tokens on the shipped weights (10 distinct of 16)
N_NEW = 16


def test_embedded_names_resolve_to_shipped_checkpoints():
    assert resolve_model_dir("tiny-v4") == EMBEDDED_MODELS["tiny-v4"]
    assert resolve_model_dir("tiny-v3") == EMBEDDED_MODEL
    for path in EMBEDDED_MODELS.values():
        assert (path / "config.json").is_file() and (path / "training_report.json").is_file()


def test_unknown_embedded_name_lists_the_known_ones():
    with pytest.raises(CheckpointError) as info:
        LLM(model="tiny-v5")
    msg = str(info.value)
    assert "'tiny-v5'" in msg and "tiny-v3, tiny-v4" in msg and "\n" not in msg


def test_tiny_v4_greedy_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    path = EMBEDDED_MODELS["tiny-v4"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            experts_implementation="eager").eval()
    prompt = [hf.config.bos_token_id] + tok.encode(PROMPT, add_special_tokens=False).ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(N_NEW):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))

    llm = LLM(model="tiny-v4", dtype="float32", max_num_seqs=2, kv_cache_memory=16 << 20)
    assert type(llm.engine.model).__name__ == "DeepseekV4ForCausalLM"
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert out.error is None, out.error
    assert out.outputs[0].token_ids == ids[len(prompt):]
    llm.engine.blocks.check_no_leaks()
    llm.shutdown()
