"""The typed engine API that plugins program against: ``EngineView``, the hook contract (order,
editable logits), the scheduler's declared admission, the MoE route hook, KV-store defaults, the
platform's communicator and feature metrics merged over dp ranks."""

from __future__ import annotations

import ast
import inspect
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams, hookspecs
from deepinfer_core.communicator import TorchDistCommunicator
from deepinfer_core.engine.scheduler import FcfsScheduler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine_view import EngineView
from deepinfer_core.features import make_plugin_manager
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv_store import KVStore
from deepinfer_core.parallel.launcher import merge_feature_metrics
from deepinfer_core.scheduler import AdmitAll, SchedulerBudget
from hardware.cpu import CpuPlatform
from plugins.dspark.feature import DSpark
from plugins.dspark.policy import LiveCost, StepCost
from plugins.structured_output.feature import StructuredOutput

BS = 4


def make(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=8, kv_cache_memory=2 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


def always_draft(llm: LLM) -> None:
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)


# ---- EngineView and the hookspecs ----------------------------------------------------------------

def test_engine_is_an_engine_view(tiny_v3_path):
    eng = make(tiny_v3_path).engine
    assert isinstance(eng, EngineView)
    assert eng.comm is None and eng.expert_parallel is None and eng.num_nodes == 1
    seq = eng.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=1))
    assert eng.get_request(seq.request_id) is seq and eng.get_request("nope") is None


def test_every_hookspec_is_typed_and_documented_and_names_no_private_attribute():
    src = Path(hookspecs.__file__).read_text()
    tree = ast.parse(src)
    specs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(specs) >= 18
    for fn in specs:
        doc = ast.get_docstring(fn) or ""
        for arg in fn.args.args:
            assert arg.annotation is not None, f"{fn.name}({arg.arg}) is untyped"
            assert f":param {arg.arg}:" in doc, f"{fn.name}: no :param {arg.arg}: doc"
        assert fn.returns is not None, f"{fn.name} has no return type"
        assert "._" not in doc, f"{fn.name}'s doc names a private attribute"
    # EngineView lists only public names
    members = [n for n, v in vars(EngineView).items() if callable(v)] + list(EngineView.__annotations__)
    assert not [n for n in members if n.startswith("_") and not n.startswith("__")]


# ---- hook order and process_logits --------------------------------------------------------------

class Recorder:
    """Records tokens_sampled / request_finished per request, and bans a token in process_logits
    by editing the logits in place."""

    def __init__(self, banned: int | None = None) -> None:
        self.events: dict[str, list] = {}
        self.banned = banned

    @hookimpl
    def process_logits(self, engine, batch, logits):
        assert logits.shape[0] == len(batch.sample_seqs)
        if self.banned is not None:
            logits[:, self.banned] = float("-inf")  # in place: what is sampled

    @hookimpl
    def tokens_sampled(self, engine, batch, token_ids):
        assert len(batch.sample_seqs) == len(token_ids)
        for seq, tok in zip(batch.sample_seqs, token_ids):
            assert not seq.is_finished, "tokens_sampled for a request already finished"
            self.events.setdefault(seq.request_id, []).append(("tok", tok))

    @hookimpl
    def request_finished(self, engine, request):
        self.events.setdefault(request.request_id, []).append(("fin", list(request.output_token_ids)))


PROMPTS = [rand_ids(5 + 3 * i, seed=40 + i) for i in range(4)]


def _stop_params(llm: LLM) -> list[SamplingParams]:
    """Greedy requests that stop on a token they produce (stop_token_ids) mid-generation."""
    plain = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    return [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                           stop_token_ids=[o.outputs[0].token_ids[3 + i % 3]]) for i, o in enumerate(outs)]


@pytest.mark.parametrize("mode", ["sync", "async", "dspark"])
def test_tokens_sampled_for_the_last_token_comes_before_request_finished(tiny_v3_path, mode, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    kw = {"async_scheduling": mode == "async"}
    if mode == "dspark":
        kw.update(features=["dspark"], dspark={"draft": str(tiny_v3_path), "k": 3})
    llm = make(tiny_v3_path, **kw)
    if mode == "dspark":
        always_draft(llm)
    ps = _stop_params(llm)
    rec = Recorder()
    llm.engine.pm.register(rec)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], ps, use_tqdm=False)
    for o, p in zip(outs, ps):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids[-1] in p.stop_token_ids
        events = rec.events[o.request_id]
        assert events[-1][0] == "fin" and [e for e in events if e[0] == "fin"] == [events[-1]]
        toks = [t for kind, t in events if kind == "tok"]
        assert toks == events[-1][1] == o.outputs[0].token_ids  # every token, the stop token last
    if mode == "dspark":
        assert llm.engine.metrics()["dspark_accepted"] > 0  # stops came inside multi-token appends
    llm.engine.blocks.check_no_leaks()


@pytest.mark.parametrize("async_on", [False, True])
def test_process_logits_may_edit_the_logits_in_place(tiny_v3_path, async_on):
    llm = make(tiny_v3_path, async_scheduling=async_on)
    greedy = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    banned = plain[0][0]
    llm.engine.pm.register(Recorder(banned))
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert all(o.error is None and banned not in o.outputs[0].token_ids for o in outs)
    assert outs[0].outputs[0].token_ids[0] != banned
    for o, want in zip(outs, plain):
        if banned not in want:  # rows without the banned token are untouched
            assert o.outputs[0].token_ids == want


# ---- the scheduler's declared contract -----------------------------------------------------------

def test_scheduler_gets_its_admission_by_construction(tiny_v3_path):
    eng = make(tiny_v3_path).engine
    sched = eng.scheduler
    assert "is_ready" not in vars(sched) and "admit_prefix" not in vars(sched)  # nothing monkey-patched
    assert sched.admission is not None and not isinstance(sched.admission, AdmitAll)
    seq = eng.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=1))
    assert sched.num_waiting() == 1 and eng.load_stats()["waiting"] == 1
    assert eng.load_stats()["max_running"] == sched.budget.max_num_seqs == eng.cfg.max_num_seqs
    sched.remove_waiting(seq)
    assert sched.num_waiting() == 0
    sched.remove_waiting(seq)  # absent: no-op


def test_a_scheduler_without_an_engine_admits_everything(tiny_v3_path):
    blocks = make(tiny_v3_path).engine.blocks
    sched = FcfsScheduler(SchedulerBudget(4, 64), blocks, None)
    seq = Sequence("r", None, [3, 4, 5, 6, 7], SamplingParams(max_tokens=2), 0, [])
    sched.add(seq)
    out = sched.schedule()
    assert [s.seq for s in out.prefills] == [seq] and out.prefills[0].num_new_tokens == 5
    assert sched.num_running() == 1 and sched.num_waiting() == 0
    assert sched.running_requests() == [seq]  # declared on the ABC: what a dp rank's budget split reads
    sched.finish(seq)
    assert sched.running_requests() == []
    blocks.check_no_leaks()


def test_worker_reads_the_scheduler_through_its_abc_only():
    import deepinfer_core.parallel.worker as worker
    from deepinfer_core.scheduler import Scheduler

    src = inspect.getsource(worker)
    assert "getattr(self.scheduler" not in src and "self.scheduler.running_requests()" in src
    assert Scheduler.running_requests is not None and "running_requests" not in Scheduler.__abstractmethods__


# ---- the MoE route hook --------------------------------------------------------------------------

class CountRoutes:
    def __init__(self) -> None:
        self.layers: set[int] = set()

    @hookimpl
    def moe_route_hook(self, engine):
        def route(layer, weights, ids):
            self.layers.add(layer)
            return weights, ids
        return route


def test_moe_route_hook_is_installed_on_every_declared_moe_layer(tiny_v3_path, monkeypatch):
    from deepinfer_core.engine import engine as engine_mod

    counter = CountRoutes()
    real = engine_mod.make_plugin_manager

    def with_counter():
        pm = real()
        pm.register(counter, name="count_routes")
        return pm

    monkeypatch.setattr(engine_mod, "make_plugin_manager", with_counter)
    llm = make(tiny_v3_path)
    moes = llm.engine.model.moe_layers()
    assert moes and llm.engine.runner.route_hook is not None
    assert "moe_route_hook" in llm.engine.runner.graphs_off_reason or llm.engine.runner.graphs is None
    plain = make(tiny_v3_path)
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert (llm.generate([{"prompt_token_ids": PROMPTS[0]}], p, use_tqdm=False)[0].outputs[0].token_ids
            == plain.generate([{"prompt_token_ids": PROMPTS[0]}], p, use_tqdm=False)[0].outputs[0].token_ids)
    assert counter.layers == set(moes)


# ---- KV store defaults, the platform's communicator ------------------------------------------------

class DictStore(KVStore):
    """A store with only the required methods."""

    core_api_version = "1.0"

    def __init__(self) -> None:
        self.d: dict[int, torch.Tensor] = {}

    def contains(self, key):
        return key in self.d

    def put(self, key, block, **meta):
        self.d[key] = block.clone()
        return True

    def get(self, key):
        return self.d.get(key)

    def evict(self, key):
        return self.d.pop(key, None) is not None


def test_optional_kv_store_methods_have_working_defaults():
    s = DictStore()
    block = torch.arange(6.0).reshape(1, 2, 3)
    s.put(7, block)
    got = s.get_many([7, 8], ttl_class="agent", out=[torch.empty(1, 2, 3), None])
    assert torch.equal(got[0], block) and got[1] is None
    assert s.ttl_seconds("agent") is None and s.allocate() is None and s.prefault(1 << 20) == 0
    s.adopt(9, block)
    s.recycle(block)
    assert torch.equal(s.get(9), block) and s.match_prefix([7, 9, 8]) == 2


def test_platform_provides_the_communicator():
    class OwnComm(TorchDistCommunicator):
        pass

    class OwnPlatform(CpuPlatform):
        def communicator(self):
            return OwnComm()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert type(CpuPlatform().communicator()) is TorchDistCommunicator
        comm = OwnPlatform().communicator()
        assert isinstance(comm, OwnComm) and comm.world_size == 1
        assert comm.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    from deepinfer_core.parallel import worker

    assert "platform.communicator()" in inspect.getsource(worker.RankWorker.init)


# ---- feature metrics over dp ranks ---------------------------------------------------------------

def test_feature_metrics_are_merged_over_ranks():
    pm = make_plugin_manager()
    pm.register(DSpark({}), name="dspark")
    pm.register(StructuredOutput({}), name="structured_output")

    def rank(steps, verified, accepted, so_requests):
        return {"dspark_draft": "mtp", "dspark_decode_steps": steps, "dspark_verified": verified,
                "dspark_accepted": accepted, "dspark_steps_without_drafts": 1, "dspark_proposals": steps,
                "dspark_draft_depth_total": 2 * steps, "dspark_draft_time": 0.5, "dspark_verify_time": 1.0,
                "dspark_schedule_time": 0.1, "dspark_cost_verify_scale": 1.0, "dspark_cost_draft_scale": 2.0,
                "dspark_cost_extra_overhead": 0.0, "dspark_accept_rate": accepted / verified,
                "dspark_blocked_explorations": 2, "dspark_measured_vetoes": 1, "dspark_plain_probes": 8,
                "dspark_trials": 0,
                "so_requests": so_requests, "so_mask_wait_s": 0.25}

    out = merge_feature_metrics(pm, [rank(10, 20, 10, 3), rank(30, 20, 20, 4)])
    assert out["dspark_decode_steps"] == 40 and out["dspark_verified"] == 40 and out["dspark_accepted"] == 30
    assert out["dspark_accept_rate"] == pytest.approx(0.75) and out["dspark_mean_accepted_len"] == pytest.approx(0.75)
    assert out["dspark_mean_draft_depth"] == pytest.approx(2.0) and out["dspark_draft_time"] == pytest.approx(1.0)
    assert out["dspark_draft"] == "mtp" and out["dspark_blocked_explorations"] == 4 and out["dspark_plain_probes"] == 16
    assert out["so_requests"] == 7 and out["so_mask_wait_s"] == pytest.approx(0.5)


def test_plugins_read_only_what_engine_view_declares():
    """Every ``engine.<name>`` a plugin reads (the hooks' and proposers' ``engine`` argument) is a
    member of ``EngineView``: no plugin reaches into the runner, the scheduler or private state."""
    declared = set(EngineView.__annotations__) | {n for n, v in vars(EngineView).items() if callable(v)}
    root = Path(__file__).resolve().parents[1] / "plugins"
    undeclared = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine"
                    and node.attr not in declared):
                undeclared.append(f"{path.relative_to(root)}:{node.lineno} engine.{node.attr}")
    assert not undeclared, undeclared
    assert "probe_forward" in declared
