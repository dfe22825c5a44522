"""Data-parallel attention + expert-parallel MoE (``LLM(dp=N, ep=N)``) on CPU/gloo: dispatch/combine,
equivalence with one rank, idle ranks, faults, shutdown without orphans, torchrun, config errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from parallel_helpers import (
    BS,
    alive,
    assert_same,
    children_of,
    ep_checkpoint,
    make_llm,
    params,
    rand_ids,
    wait_gone,
    workload,
)
from tiny_models import kv_bytes_per_block

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError, compose
from deepinfer_core.llm import to_output
from deepinfer_core.models.loader import EMBEDDED_MODEL, load_model_config
from deepinfer_core.parallel import DPLoadBalancer, WorkerFailure, check_parallel_config
from deepinfer_core.parallel.selftest import check_expert_parallel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> str:
    return ep_checkpoint(tmp_path_factory.getbasetemp())


def kv_blocks(path, n: int) -> int:
    return n * kv_bytes_per_block(path, BS)


@pytest.fixture(scope="module")
def reference(ckpt):
    """One-rank outputs of the workload (small KV: it preempts, and the shared prefix hits the cache)."""
    llm = make_llm(ckpt, kv_cache_memory=kv_blocks(ckpt, 40))
    outs = llm.generate(workload(), params(), use_tqdm=False)
    single = llm.generate(workload()[:1], params()[:1], use_tqdm=False)
    m = llm.metrics()
    llm.shutdown()
    assert m["preemptions"] > 0
    return outs, single


def shut(llm: LLM) -> None:
    pids = llm.engine.worker_pids()
    llm.shutdown()
    assert wait_gone(pids) == [], "worker processes left after shutdown"


# ---- dispatch / combine --------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_and_migration_match_single_process(world_size):
    # bit-identical to one process running fused_moe over every rank's tokens; also after moving the
    # experts to a placement with replicas (uneven tokens per rank, one rank with none)
    check_expert_parallel(world_size)


def test_combine_sums_in_logical_expert_order():
    import torch

    from deepinfer_core.parallel import combine

    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 8, generator=g)
    w = torch.rand(5, 3, generator=g)
    ids = torch.tensor([[2, 0, 1], [0, 1, 2], [1, 2, 0], [2, 1, 0], [0, 2, 1]])
    out = combine(y, w, ids, torch.float32)
    for t in range(5):
        acc = torch.zeros(8)
        for j in ids[t].argsort().tolist():
            acc = acc + y[t, j] * w[t, j]
        assert torch.equal(out[t], acc)


# ---- equivalence with one rank -------------------------------------------------------------------

@pytest.mark.parametrize("world_size,kv", [(2, 40), (4, 17)])
def test_dp_ep_matches_single_rank(ckpt, reference, world_size, kv):
    """Greedy and seeded-sampled tokens (and logprobs) equal dp=ep=1, with prefix caching and
    preemption on every rank; an idle rank runs dummy steps (a lone request)."""
    ref, ref_single = reference
    llm = make_llm(ckpt, dp=world_size, ep=world_size, kv_cache_memory=kv_blocks(ckpt, kv))
    try:
        outs = llm.generate(workload(), params(), use_tqdm=False)
        assert_same(outs, ref)
        m = llm.metrics()
        assert m["preemptions"] > 0
        assert all(r["preemptions"] > 0 for r in m["ranks"]), [r["preemptions"] for r in m["ranks"]]
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0
        assert m["dp_requests_per_rank"] == [8 // world_size] * world_size
        assert m["steps"] > 0 and 1.0 <= m["moe_lb"] < world_size
        assert set(m["moe_lb_per_layer"]) == {1, 2}
        # one request: the other ranks have nothing to do and must still join every MoE collective
        single = llm.generate(workload()[:1], params()[:1], use_tqdm=False)
        assert_same(single, ref_single)
        assert llm.metrics()["dummy_steps"] >= (world_size - 1) * len(single[0].outputs[0].token_ids)
        # bad requests fail alone; text prompts go through the driver's tokenizer
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [10**6]}, "ab"],
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
        assert outs[1].outputs[0].finish_reason == "error" and "outside the vocabulary" in str(outs[1].error)
        assert outs[2].error is None and outs[2].prompt == "ab"
        with pytest.raises(ValueError, match="so_args"):
            llm.engine.add_request("x", SamplingParams(so_args={"json": {}}))
        # a seed beyond 64 bits and prompt_logprobs beyond the vocabulary break no rank (issue 14)
        sp = [SamplingParams(temperature=1.0, seq_seed=s, max_tokens=4, ignore_eos=True, prompt_logprobs=5000)
              for s in (2**64 + 3, 3)]
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, sp, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # the seed modulo 2**64
    finally:
        shut(llm)


def test_default_model_matches_single_rank():
    """The embedded model, text prompts sharing a prefix, a KV budget small enough to preempt."""
    if not (EMBEDDED_MODEL / "config.json").is_file():
        pytest.skip("the embedded default model is not trained yet")
    head = "import os\nimport sys\n\n\n"
    prompts = [head + t for t in ("def fibonacci(n):\n", "def list_files(root):\n", "class Stack:\n",
                                  "def main():\n    for i in ", "# read the config\n", "def parse(args):\n",
                                  "class Node:\n    def __init__(self", "if __name__ == ")]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    kw = dict(dtype="float32", block_size=8, kv_cache_memory=7 * kv_bytes_per_block(EMBEDDED_MODEL, 8))
    ref_llm = LLM(**kw)
    ref = ref_llm.generate(prompts, sp, use_tqdm=False)
    assert ref_llm.metrics()["preemptions"] > 0
    ref_llm.shutdown()
    for world_size in (2, 4):
        llm = LLM(dp=world_size, ep=world_size, **kw)
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            assert_same(outs, ref)
            assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
            m = llm.metrics()
            assert all(r["preemptions"] > 0 for r in m["ranks"]), [r["preemptions"] for r in m["ranks"]]
            assert sum(o.metrics.num_cached_tokens for o in outs) > 0
        finally:
            shut(llm)


# ---- requests, balancing -------------------------------------------------------------------------

def test_load_balancer_prefers_fewer_requests_then_lower_kv_usage():
    lb = DPLoadBalancer(3)
    assert [lb.pick() for _ in range(3)] == [0, 1, 2]
    lb.report(0, 1, 0.9)
    lb.report(1, 1, 0.1)
    lb.report(2, 1, 0.5)
    assert lb.pick() == 1
    lb.finished(0)
    lb.finished(0)
    assert lb.pick() == 0
    assert lb.assigned_total == [2, 2, 1]


# ---- faults --------------------------------------------------------------------------------------

def _start_long_run(ckpt, **kw):
    llm = make_llm(ckpt, dp=2, ep=2, **kw)
    eng = llm.engine
    seqs = [eng.add_request({"prompt_token_ids": rand_ids(12, i)},
                            SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)) for i in range(4)]
    for _ in range(3):
        eng.step()
    return llm, eng, seqs


def _drain(eng, limit_s: float) -> float:
    t0 = time.monotonic()
    while eng.has_unfinished():
        eng.step()
        assert time.monotonic() - t0 < limit_s, "the driver hangs instead of failing the requests"
    return time.monotonic() - t0


def test_dead_worker_fails_pending_requests_and_names_the_rank(ckpt):
    llm, eng, seqs = _start_long_run(ckpt, worker_timeout_s=30.0)
    pids = eng.worker_pids()
    try:
        os.kill(pids[1], signal.SIGKILL)
        _drain(eng, 20.0)
        outs = [to_output(s, eng.tokenizer) for s in seqs]
        for o in outs:
            assert o.outputs[0].finish_reason == "error"
            assert isinstance(o.error, WorkerFailure)
            assert o.error.ranks == [1]
            assert "rank 1" in str(o.error) and "SIGKILL" in str(o.error)
            assert "\n" not in str(o.error) and "Traceback" not in str(o.error)  # one line per rank
        with pytest.raises(WorkerFailure, match="rank 1"):
            eng.add_request({"prompt_token_ids": [5, 6]}, None)
        assert wait_gone(pids) == [], "surviving ranks were not stopped"
    finally:
        llm.shutdown()


def test_hung_worker_is_detected_within_worker_timeout(ckpt):
    llm, eng, seqs = _start_long_run(ckpt, worker_timeout_s=3.0)
    pids = eng.worker_pids()
    try:
        os.kill(pids[1], signal.SIGSTOP)
        took = _drain(eng, 15.0)
        assert 2.5 < took < 10.0
        for s in seqs:
            assert s.finish_reason == "error" and isinstance(s.error, WorkerFailure)
            assert "rank 1" in str(s.error) and "worker_timeout_s=3s" in str(s.error)
            assert s.error.ranks == [1]
        assert wait_gone(pids) == []
    finally:
        llm.shutdown()


DRIVER = textwrap.dedent("""
    import sys
    from deepinfer_core import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", dp=2, ep=2, kv_cache_memory=2 << 20, block_size=4)
    print("PIDS", *llm.engine.worker_pids(), flush=True)
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    while True:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 4, sp, use_tqdm=False)
""")


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9"])
def test_no_orphans_when_the_driver_is_interrupted_or_killed(ckpt, tmp_path, how):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    # Ctrl-C as from a terminal: a runner started in the background (no job control) ignores SIGINT and
    # its children inherit that, so restore the default disposition in the driver
    proc = subprocess.Popen([sys.executable, str(script), ckpt], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        assert sorted(children_of(proc.pid)) == sorted(pids)
        time.sleep(0.5)  # mid-generation
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        # communicate, not wait: the driver's log goes to a pipe, and a full pipe would block its exit
        _, err = proc.communicate(timeout=60)
        if how == "ctrl-c":
            assert "KeyboardInterrupt" in err
        assert wait_gone(pids) == [], f"orphan workers after {how} of the driver"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- torchrun ------------------------------------------------------------------------------------

def test_offline_inference_example_under_torchrun_matches_single_rank(ckpt):
    """examples/offline_inference.py --dp 2 --ep 2 launched by torchrun (the multi-node entry point,
    here with both ranks on one host): rank 0 drives, rank 1 serves it and exits with it."""
    texts = ["ab", "the ", "sent"]
    sp = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=12, seq_seed=3)  # seeded sampling
    ref_llm = make_llm(ckpt)
    ref = [t + o.outputs[0].text for t, o in zip(texts, ref_llm.generate(texts, sp, use_tqdm=False))]
    ref_llm.shutdown()
    from deepinfer_core.parallel.ranks import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), str(ROOT / "examples" / "offline_inference.py"),
           "--model", ckpt, "--dtype", "float32", "--dp", "2", "--ep", "2", "--max-tokens", "12",
           "--temperature", "0.7", "--top-p", "1.0", "--seed", "3"]
    for t in texts:
        cmd += ["--prompt", t]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(env, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = [b.strip("\n") for b in res.stdout.split("=" * 72)[1:]]
    assert [b.rsplit("\n-- finish=", 1)[0] for b in blocks] == ref, res.stdout


# ---- configuration errors ------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(dp=2, ep=4), "dp must equal ep"),
    (dict(dp=3, ep=3), "does not divide the model's n_routed_experts=16"),
    (dict(dp=32, ep=32), "more ranks than the model's n_routed_experts=16"),
])
def test_unsupported_parallel_configs_fail_before_starting_workers(ckpt, kw, match):
    before = children_of(os.getpid())
    with pytest.raises(ConfigError, match=match):
        make_llm(ckpt, **kw)
    assert children_of(os.getpid()) == before


def test_more_ranks_than_devices_and_launch_size_mismatch(ckpt):
    from deepinfer_core.platform import Availability, Platform

    class FakeGpu(Platform):
        name, device_type = "fakegpu", "cuda"

        @classmethod
        def probe(cls):
            return Availability.yes()

        def device_count(self):
            return 2

        def memory_info(self, index=0):
            return (0, 0)

    mc = load_model_config(Path(ckpt))
    cfg = compose(model=ckpt, dp=4, ep=4)
    with pytest.raises(ConfigError, match="need 4 fakegpu devices, but 2 are visible"):
        check_parallel_config(cfg, mc, FakeGpu(), local_world_size=4)
    check_parallel_config(cfg, mc, FakeGpu(), local_world_size=2)  # 2 per node x 2 nodes is fine
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 processes but dp=ep=4"):
        check_parallel_config(cfg, mc, FakeGpu(), local_world_size=2, launched_world_size=2)
    with pytest.raises(ConfigError, match="worker_timeout_s"):
        compose(worker_timeout_s=0)


def test_no_leftover_worker_processes():
    def is_worker(pid: int) -> bool:
        try:
            return b"deepinfer_core.parallel.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    assert [p for p in children_of(os.getpid()) if alive(p) and is_worker(p)] == []


# ---- Communicator.abort --------------------------------------------------------------------------
ABORT_RANK = textwrap.dedent("""
    import datetime, sys, time, types
    import torch, torch.distributed as dist
    from multiprocessing.connection import Connection
    from deepinfer_core.communicator import TorchDistCommunicator
    from deepinfer_core.parallel.worker import RankWorker, start_probe_thread
    rank, port, new_port, probe_fd = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    comm = TorchDistCommunicator()
    comm.all_reduce(torch.ones(1))
    if rank == 0:  # waits in a collective rank 1 never joins
        try:
            comm.all_reduce(torch.ones(1))
            print("rank 0: the collective returned", flush=True)
        except RuntimeError as exc:
            print(f"rank 0: the collective failed: {exc}"[:200], flush=True)
    else:  # the driver's abort arrives on the probe pipe
        worker = RankWorker(1, 2)
        worker.engine, worker.generation = types.SimpleNamespace(comm=comm, expert_parallel=None), 1
        worker.describe = lambda: "aborted" if comm.aborted else "idle"  # what the probe answers
        start_probe_thread(Connection(probe_fd), worker)
        while not comm.aborted:
            time.sleep(0.01)
        comm.abort()  # again: nothing left to do
        assert not dist.is_initialized()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{new_port}", rank=0, world_size=1)
        print("rank 1 aborted and joined a new group", flush=True)
""")


def test_probe_abort_ends_a_peers_blocked_collective():
    """Elastic EP's abort path on gloo: the driver's ("abort", generation) on a rank's probe pipe
    aborts its communicator (unless it names an older group; never answered, so probes still get
    their own answers). Its connections close, so a peer blocked on it in a collective fails now
    (the group's timeout is 600 s), and the rank can join a new group."""
    import multiprocessing.connection as mpc

    from deepinfer_core.parallel.ranks import _free_port

    port, new_port = str(_free_port()), str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ours, theirs = mpc.Pipe()
    procs = [subprocess.Popen([sys.executable, "-c", ABORT_RANK, str(r), port, new_port, str(theirs.fileno())],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              pass_fds=(theirs.fileno(),)) for r in range(2)]
    theirs.close()
    try:
        ours.send(("probe",))
        assert ours.recv() == ("alive", "idle")  # rank 1 is up, its probe thread answers
        ours.send(("abort", 0))  # an older group's: ignored (handled before the next probe is answered)
        ours.send(("probe",))
        assert ours.recv() == ("alive", "idle")
        ours.send(("abort", 1))
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "rank 0: the collective failed" in outs[0], outs[0][-2000:]
    assert "rank 1 aborted and joined a new group" in outs[1], outs[1][-2000:]
