"""Shared setup of the speculative-decoding tests (``test_dspark*.py``, ``test_spec*.py``,
``test_speculative.py``).

DSpark: the engine (``make``, ``run``, ``greedy``, ``PROMPTS``, the plain ``reference``, a step-time
curve on which drafting pays), the tiny draft checkpoints (a 1-layer draft model, an MTP layer in
the checkpoint or shipped apart), held-out prompts for the shipped drafts and the teacher-forced KV
of an MTP layer. Fixtures are imported by the test modules that use them (``_cache_dir`` is autouse
in every module that imports it).

Toy proposers: a third-party package installed as files on ``sys.path`` whose dist-info registers
proposers through ``entry_points.txt`` alone.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from stevedore import ExtensionManager
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams
from plugins.dspark.policy import LiveCost, StepCost

BS = 4


# ---- DSpark: checkpoints ---------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """Step-time curves of these tiny models go to a temporary cache."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dspark_cache"))


def _copy_files(src: Path, dst: Path, skip=("model.safetensors",)) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy(f, dst / f.name)


def write_one_layer_draft(src: Path, out: Path) -> None:
    """A 1-layer draft of the checkpoint ``src`` in ``out``: its embedding, first layer, final norm and
    LM head."""
    _copy_files(src, out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k.startswith("model.layers.0.") or not k.startswith("model.layers.")},
              str(out / "model.safetensors"))


@pytest.fixture(scope="session")
def tiny_draft(tiny_v3_path, tmp_path_factory) -> str:
    """A 1-layer draft: the target's embedding, first layer, final norm and LM head."""
    out = tmp_path_factory.mktemp("tiny_draft")
    write_one_layer_draft(Path(tiny_v3_path), out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_mtp(tiny_v3_path, tmp_path_factory) -> str:
    """The tiny target plus an MTP layer ``model.layers.{N}`` (a copy of its last layer, random eh_proj)."""
    src, out = Path(tiny_v3_path), tmp_path_factory.mktemp("tiny_mtp")
    _copy_files(src, out)
    cfg = json.loads((src / "config.json").read_text())
    N = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    C = cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)
    last = f"model.layers.{N - 1}."
    for k, v in list(t.items()):
        if k.startswith(last):
            t[f"model.layers.{N}." + k[len(last):]] = v.clone()
    for name in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.{N}.{name}.weight"] = torch.ones(C)
    t[f"model.layers.{N}.eh_proj.weight"] = torch.randn(C, 2 * C, generator=g) * 0.3
    save_file(t, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="session")
def tiny_mtp_dir(tiny_v3_path, tmp_path_factory) -> str:
    """An MTP layer shipped apart from its target (``mtp.safetensors``): a dense layer (the target's
    first), random eh_proj, as ``train_dspark_draft.py --kind mtp`` writes it."""
    src, out = Path(tiny_v3_path), tmp_path_factory.mktemp("tiny_mtp_dir")
    cfg = json.loads((src / "config.json").read_text())
    N, C = cfg["num_hidden_layers"], cfg["hidden_size"]
    t = load_file(str(src / "model.safetensors"))
    mtp = {f"model.layers.{N}." + k[len("model.layers.0."):]: v.clone() for k, v in t.items()
           if k.startswith("model.layers.0.")}
    assert f"model.layers.{N}.mlp.gate_proj.weight" in mtp  # layer 0 is dense
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{N}.{name}.weight"] = torch.ones(C)
    mtp[f"model.layers.{N}.eh_proj.weight"] = torch.randn(C, 2 * C, generator=torch.Generator().manual_seed(3)) * 0.3
    save_file(mtp, str(out / "mtp.safetensors"))
    return str(out)


# ---- DSpark: the engine ------------------------------------------------------------------------------------

def make(path, features=True, **kw) -> LLM:
    """A tiny engine with DSpark. With async scheduling forced on this CPU, DSpark's speculative steps take
    the device path (``host_steps_below = 0``) unless a test sets it: the CPU default runs them on the host
    below 8 requests (``DSpark.step_needs_sync``, ``tests/test_dspark_async.py``)."""
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=16, kv_cache_memory=2 << 20)
    opts.update(kw)
    if features:
        opts.setdefault("features", ["dspark"])
    if opts.get("async_scheduling") and "dspark" in opts.get("features", ()):
        opts["dspark"] = {"host_steps_below": 0, **opts.get("dspark", {})}
    return LLM(str(path), **opts)


def cheap_drafts(llm: LLM) -> None:
    """A step-time curve on which drafting always pays (these random models' drafts are rarely
    confident), so that the variable-length path drafts, verifies and cuts."""
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)


def run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    return outs


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


PROMPTS = [rand_ids(6 + 5 * i, 50 + i) for i in range(8)]


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    plain = make(tiny_v3_path, features=False)
    return [o.outputs[0].token_ids for o in run(plain, PROMPTS, greedy(20, logprobs=0))]


def _heldout_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if zlib.crc32(rel.encode()) % 20 == 0 and "test" not in rel.split("/")[:-1] and path.stat().st_size < 200_000:
            files.append(path)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 10:
            continue
        s = rng.randrange(len(lines) - 8)
        ids = tokenizer.encode("".join(lines[s : s + 40]))
        if len(ids) >= 48:
            out.append(ids[: rng.randint(40, 96)])
    return out


def mtp_kv_and_teacher_forced(eng, src, seq, n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer ``src``'s cached KV of ``seq``'s positions ``0 .. n-1`` and the entries computed
    from the target's teacher-forced hidden states over the whole sequence."""
    from deepinfer_core.models.metadata import AttentionMetadata, PrefillMeta

    ids = torch.tensor(seq.token_ids)
    L = len(ids)
    cache = [torch.zeros(-(-L // bs), bs, c.shape[-1]) for c in eng.kv_caches["latent"]]
    cu = torch.tensor([0, L])
    meta = AttentionMetadata(L, torch.arange(L), PrefillMeta(cu, cu, torch.tensor([L]),
                                                             torch.arange(-(-L // bs))[None].int(), False), None)
    pos = torch.arange(L)
    with torch.inference_mode():
        hidden = eng.model(ids, pos, meta, {"latent": cache})
        k = eng.kernels
        e = k.rms_norm(eng.model.embed_tokens[ids[1 : n + 1]], src.enorm, src.eps)
        x = k.linear(torch.cat((e, k.rms_norm(hidden[:n], src.hnorm, src.eps)), -1), src.eh_proj)
        x = k.rms_norm(x, src.layer.input_layernorm, src.eps)
        attn = src.layer.self_attn
        latent, k_pe = k.linear(x, attn.kv_a_proj_with_mqa).split([attn.L, attn.R], dim=-1)
        ref = torch.cat((attn.kv_a_layernorm(latent), k.rope(k_pe[:, None], pos[:n], eng.model.cos_sin)[:, 0]), -1)
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])
        got = src.caches[0].view(-1, ref.shape[-1])[slots]
    return got, ref


# ---- toy proposer packages ---------------------------------------------------------------------------------

def proposer_package_on_path(root: Path, module: str, source: str, proposers: dict[str, str]) -> Iterator[Path]:
    """Installs ``source`` as the module ``module`` in ``root`` with a dist-info whose entry_points.txt
    registers ``proposers`` (entry name -> class), what pip would write; puts ``root`` on ``sys.path``
    while the caller's fixture is alive (``yield from``), then removes it and forgets the module."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    dist = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[deepinfer.proposers]\n" + "".join(f"{name} = {module}:{cls}\n" for name, cls in proposers.items()))
    sys.path.insert(0, str(root))
    ExtensionManager.ENTRY_POINT_CACHE.pop("deepinfer.proposers", None)  # stevedore lists a group once
    yield root
    sys.path.remove(str(root))
    ExtensionManager.ENTRY_POINT_CACHE.pop("deepinfer.proposers", None)
    sys.modules.pop(module, None)
