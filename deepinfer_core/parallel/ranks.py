"""The ranks of a data-parallel / expert-parallel job: starting their processes and exchanging
messages with them (the driver side; :mod:`deepinfer_core.parallel.launcher` routes requests over them).

* one machine: one worker process per rank (``python -m deepinfer_core.parallel.worker``), each
  talking to the driver over a private pipe plus a liveness-probe pipe; the ranks form a
  ``torch.distributed`` group with the platform's backend (gloo on cpu, nccl, hccl, ...);
* several machines: the same script under ``torchrun``; rank 0 is the driver (its own rank runs
  in-process), the other ranks connect to it over TCP.

An exchange (:meth:`RankProcesses._roundtrip`) sends every rank its message and waits for every
answer, at most a deadline. A rank that dies, hangs or fails is named in a :class:`WorkerFailure`
(or, with elastic EP, a :class:`~deepinfer_core.parallel.elastic.RanksLost`); every worker
process is killed when the job fails, shuts down, or the driver exits.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing.connection as mpc
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.parallel.elastic import PEER_UNBLOCK_S, RanksLost, kill_hung, lost_ranks
from deepinfer_core.ports import free_port as _free_port

logger = logging.getLogger("deepinfer.parallel")
STARTUP_TIMEOUT_MIN_S = 300.0  # model loading may take longer than a step
PROBE_TIMEOUT_S = 1.0  # a live rank's probe thread answers well within this


class WorkerFailure(RuntimeError):
    """A rank died, hung or failed; ``ranks`` names the culprits."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):
        return (WorkerFailure, (str(self), self.ranks))


def torchrun_env(env=None) -> dict | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR of a torchrun launch, or None."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return {"rank": int(env["RANK"]), "world_size": world, "local_rank": int(env.get("LOCAL_RANK", 0)),
            "local_world_size": local_world, "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "num_nodes": world // local_world if local_world and world % local_world == 0 else 1}


# ---- channels to ranks ---------------------------------------------------------------------------
class _Remote:
    """A rank in another process (a local child, or a torchrun peer over TCP): its message
    connection, its liveness-probe connection (answered by a thread), its process if a child."""

    def __init__(self, rank: int, conn, probe, proc: subprocess.Popen | None = None,
                 pid: int | None = None) -> None:
        self.rank, self.conn, self.probe, self.proc = rank, conn, probe, proc
        self.pid = proc.pid if proc is not None else pid

    def send_probe(self) -> bool:
        try:
            self.probe.send(("probe",))
            return True
        except OSError:
            return False

    def send_abort(self, generation: int) -> None:
        """Ask the rank's probe thread to abort its process group (a peer died; elastic EP)."""
        try:
            self.probe.send(("abort", generation))
        except OSError:
            pass

    def exit_status(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"


class _InProcess:
    """Rank 0 under torchrun: its worker runs in the driver's process, each message in a thread (so
    that the driver keeps its deadline while the rank waits in a collective)."""

    def __init__(self, rank: int, worker) -> None:
        self.rank, self.worker, self.pid, self.proc = rank, worker, os.getpid(), None
        self.reply: queue.Queue = queue.Queue()

    def send(self, msg) -> None:
        def run() -> None:
            self.reply.put(self.worker.handle(msg))

        threading.Thread(target=run, daemon=True, name=f"deepinfer-rank{self.rank}").start()

    def exit_status(self) -> str | None:
        return None


def _reap(procs: list[subprocess.Popen], grace_s: float = 0.0, force: bool = False) -> None:
    """Make sure every worker process is gone: wait ``grace_s``, then SIGTERM, then SIGKILL
    (``force``: SIGKILL at once)."""
    if force:
        for p in procs:
            if p.poll() is None:
                p.kill()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.poll() is None and grace_s > 0:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def group_timeout_s(cfg: EngineConfig) -> float:
    """The process group's collective timeout: longer than ``worker_timeout_s``, so that when a
    rank hangs its peers are still waiting (and answer the driver's probe) at the driver's deadline."""
    t = float(cfg.worker_timeout_s)
    return max(2 * t, t + 30.0)


# ---- the driver's side of the ranks --------------------------------------------------------------
class RankProcesses:
    """Starts the ranks and exchanges messages with them; the base of the driver
    (:class:`~deepinfer_core.parallel.launcher.ParallelEngine`), which sets ``cfg``, ``platform`` and
    ``world_size`` first and defines ``_fail_requests(failure)``."""

    def _init_ranks(self, tr: dict | None) -> None:
        """Start every rank (locally spawned, or the torchrun peers when ``tr`` is a torchrun launch)."""
        self._failure: WorkerFailure | None = None
        self._procs: list[subprocess.Popen] = []
        self._chans: list = []
        self._rebase = [False] * self.world_size  # ranks on another host: their clocks differ
        self.worker_info: list[dict] = []
        self.generation = 0  # the ranks' process group: 0, then one more per elastic re-form
        self._finalizer = weakref.finalize(self, _reap, self._procs)  # also at interpreter exit
        try:
            if tr is None:
                self._start_local()
            else:
                self._start_torchrun(tr)
        except BaseException:
            self._kill_all()
            raise

    # ---- start-up --------------------------------------------------------------------------
    def _init_payload(self, init_method: str | None) -> dict:
        return {"cfg": self.cfg, "init_method": init_method, "timeout_s": group_timeout_s(self.cfg)}

    def _start_local(self) -> None:
        W = self.world_size
        env = dict(os.environ)
        # the workers import (and find plugins) exactly as the driver does, installed or not
        paths = [os.path.abspath(p or ".") for p in sys.path if os.path.exists(p or ".")]
        paths.append(str(Path(__file__).resolve().parents[2]))
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        for r in range(W):
            ours, theirs = mpc.Pipe(duplex=True)
            probe, probe_theirs = mpc.Pipe(duplex=True)
            boot = {"rank": r, "world_size": W, "local_rank": r, "local_world_size": W, "num_nodes": 1,
                    "fd": theirs.fileno(), "probe_fd": probe_theirs.fileno(), "ppid": os.getpid()}
            proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.parallel.worker"],
                                    stdin=subprocess.PIPE, env=env,
                                    pass_fds=(theirs.fileno(), probe_theirs.fileno()))
            self._procs.append(proc)
            theirs.close()
            probe_theirs.close()
            proc.stdin.write((json.dumps(boot) + "\n").encode())
            proc.stdin.close()
            self._chans.append(_Remote(r, ours, probe, proc))
        init = f"tcp://127.0.0.1:{_free_port()}"
        self._start_ranks([("init", self._init_payload(init))] * W)

    def _start_torchrun(self, tr: dict) -> None:
        import torch.distributed as dist

        from deepinfer_core.parallel.worker import RankWorker, serve, start_probe_thread

        rank, W = tr["rank"], tr["world_size"]
        self.platform.set_device(tr["local_rank"])
        timeout = datetime.timedelta(seconds=group_timeout_s(self.cfg))
        if not dist.is_initialized():
            dist.init_process_group(self.platform.dist_backend, init_method="env://", timeout=timeout)
        worker = RankWorker(rank, W, tr["local_rank"], tr["local_world_size"], tr["num_nodes"])
        if rank != 0:
            info = [None, None, None]
            dist.broadcast_object_list(info, src=0)
            addr, port, key = info
            addr = os.environ.get("DEEPINFER_DRIVER_ADDR", addr)
            conn = mpc.Client((addr, port), authkey=bytes.fromhex(key))
            conn.send(("hello", rank, os.getpid()))
            probe = mpc.Client((addr, port), authkey=bytes.fromhex(key))
            probe.send(("probe", rank, os.getpid()))
            start_probe_thread(probe, worker)
            graceful = serve(conn, worker)
            conn.close()
            if not graceful:
                os._exit(1)  # peers may be stuck in collectives; do not wait for them
            raise SystemExit(0)  # this process served rank 0; the rest of the script is rank 0's

        key = secrets.token_bytes(32)
        bind = os.environ.get("DEEPINFER_DRIVER_BIND", "0.0.0.0")
        listener = mpc.Listener((bind, int(os.environ.get("DEEPINFER_DRIVER_PORT", "0"))), authkey=key)
        dist.broadcast_object_list([tr["master_addr"], listener.address[1], key.hex()], src=0)
        accepted: queue.Queue = queue.Queue()

        def accept() -> None:
            for _ in range(2 * (W - 1)):  # a message and a probe connection per remote rank
                try:
                    c = listener.accept()
                    accepted.put((c, c.recv()))
                except Exception as exc:  # a bad client; reported by the wait below
                    accepted.put((None, exc))
                    return

        threading.Thread(target=accept, daemon=True, name="deepinfer-accept").start()
        conns: dict[tuple[str, int], tuple] = {}
        deadline = time.monotonic() + max(STARTUP_TIMEOUT_MIN_S, self.cfg.worker_timeout_s)
        for _ in range(2 * (W - 1)):
            try:
                conn, hello = accepted.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted({r for r in range(1, W) for k in ("hello", "probe") if (k, r) not in conns})
                raise WorkerFailure(f"rank(s) {missing} did not connect to the driver", missing) from None
            if conn is None:
                raise WorkerFailure(f"a rank failed to connect to the driver: {hello}", [])
            kind, r, pid = hello
            conns[(kind, r)] = (conn, pid)
        listener.close()
        self._chans = [_InProcess(0, worker)]
        for r in range(1, W):
            (conn, pid), (probe, _) = conns[("hello", r)], conns[("probe", r)]
            self._chans.append(_Remote(r, conn, probe, pid=pid))
            self._rebase[r] = True
        self._start_ranks([("init", self._init_payload(None))] * W)

    def _start_ranks(self, msgs: list) -> None:
        timeout = max(STARTUP_TIMEOUT_MIN_S, self.cfg.worker_timeout_s)
        replies = self._roundtrip(msgs, timeout, startup=True)
        self.worker_info = replies
        for ch, info in zip(self._chans, replies):
            ch.pid = info["pid"]

    # ---- the exchange with every rank ------------------------------------------------------
    def _roundtrip(self, msgs: list, timeout: float, startup: bool = False) -> list:
        """Send ``msgs[r]`` to rank r and return every rank's answer. A rank that dies, stays silent
        ``timeout`` seconds or answers with an error fails the whole engine (WorkerFailure)."""
        if self._failure is not None:
            raise self._failure
        W = self.world_size
        replies: list = [None] * W
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        detected = float("inf")  # when the first loss was seen (elastic EP's failure-to-serving time)
        aborted = False  # elastic EP: the survivors were told to abort the broken group
        completed = False
        try:
            for ch in self._chans:
                try:
                    (ch.conn.send if isinstance(ch, _Remote) else ch.send)(msgs[ch.rank])
                except OSError as exc:
                    errors[ch.rank] = f"connection lost ({exc})"
            pending = {ch.rank for ch in self._chans if ch.rank not in errors}
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    detected = min(detected, time.perf_counter())
                    self._diagnose_silent(pending, timeout, errors)
                    if self.cfg.elastic_ep and msgs[0][0] == "step" and kill_hung(self._chans, pending, errors):
                        deadline = time.monotonic() + PEER_UNBLOCK_S  # their blocked peers answer now
                        continue
                    break
                remote = {self._chans[r].conn: r for r in pending if isinstance(self._chans[r], _Remote)}
                local = [r for r in pending if isinstance(self._chans[r], _InProcess)]
                wait_s = min(left, 0.5) if not local else min(left, 0.02)
                if remote:
                    ready = mpc.wait(list(remote), timeout=wait_s)
                else:
                    time.sleep(wait_s)
                    ready = []
                for conn in ready:
                    r = remote[conn]
                    pending.discard(r)
                    try:
                        replies[r] = conn.recv()
                    except (EOFError, OSError):
                        detected = min(detected, time.perf_counter())
                        errors[r] = "died" + self._death_note(r)
                for r in local:
                    try:
                        replies[r] = self._chans[r].reply.get_nowait()
                        pending.discard(r)
                    except queue.Empty:
                        pass
                for r in list(pending):
                    ch = self._chans[r]
                    status = ch.exit_status()
                    if status is not None and not ch.conn.poll():
                        pending.discard(r)
                        detected = min(detected, time.perf_counter())
                        errors[r] = f"died ({status})"
                if detected < float("inf") and not aborted and self.cfg.elastic_ep and msgs[0][0] == "step":
                    aborted = True  # a peer is gone: the others' collectives must not wait for it
                    for r in pending:
                        if isinstance(self._chans[r], _Remote):
                            self._chans[r].send_abort(self.generation)
            completed = True
        finally:
            if not completed:  # interrupted (Ctrl-C) or an exception mid-exchange: ranks are out of step
                self._fail({}, "the driver was interrupted during a step")
        rank_exc: dict[int, BaseException] = {}
        for r, rep in enumerate(replies):
            if rep is not None and rep[0] == "error":
                rank_exc[r] = rep[1]
                errors[r] = f"raised {type(rep[1]).__name__}: {rep[1]}\n{rep[2]}"
        if errors:
            user_errors = all(isinstance(e, (ConfigError, ValueError)) for e in rank_exc.values())
            if startup and rank_exc and user_errors:
                r, exc = min(rank_exc.items())
                self._fail(errors)
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(raised on rank {r} of the parallel engine)")
                raise exc  # e.g. a feature's ConfigError: the same error a one-rank engine raises
            lost = lost_ranks(errors) if self.cfg.elastic_ep and msgs[0][0] == "step" else []
            if lost and len(lost) < W:
                raise RanksLost(lost, errors, detected)
            raise self._fail(errors)
        return [rep[1] for rep in replies]

    def _diagnose_silent(self, pending: set[int], timeout: float, errors: dict[int, str]) -> None:
        """Probe the ranks that did not answer in time: a rank whose probe thread answers is alive
        and waiting (usually in a collective, for a peer); one that does not answer is hung."""
        probed = {}
        for r in pending:
            ch = self._chans[r]
            if isinstance(ch, _InProcess):
                probed[r] = ch.worker.describe()
            elif ch.send_probe():
                probed[r] = None
        end = time.monotonic() + PROBE_TIMEOUT_S
        waiting = {self._chans[r].probe: r for r, v in probed.items() if v is None}
        while waiting and time.monotonic() < end:
            for conn in mpc.wait(list(waiting), timeout=max(0.0, end - time.monotonic())):
                r = waiting.pop(conn)
                try:
                    probed[r] = conn.recv()[1]
                except (EOFError, OSError):
                    pass
        for r in pending:
            note = f"no answer within worker_timeout_s={timeout:g}s"
            status = self._chans[r].exit_status()
            if status is not None:
                errors[r] = f"died ({status})"
            elif probed.get(r) is None:
                errors[r] = f"{note}: hung (its process does not respond)"
            else:
                errors[r] = f"{note}; alive, waiting in {probed[r]}"

    def _death_note(self, r: int) -> str:
        ch = self._chans[r]
        if ch.proc is None:
            return " (connection closed)"
        try:
            ch.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return " (connection closed)"
        return f" ({ch.exit_status()})"

    def _fail(self, errors: dict[int, str], note: str = "") -> WorkerFailure:
        """Record the failure, kill every worker, fail every unfinished request (``_fail_requests``)."""
        if self._failure is not None:
            return self._failure
        time.sleep(0.2)  # a peer's death often reaches the other ranks first: let exit codes settle
        for ch in self._chans:
            status = ch.exit_status()
            if status is not None and not str(errors.get(ch.rank, "")).startswith("died"):
                errors[ch.rank] = f"died ({status})"
        dead = sorted(r for r, e in errors.items() if e.startswith(("died", "connection")) or "hung" in e)
        dead = dead or sorted(r for r, e in errors.items() if e.startswith("no answer"))
        culprits = dead or sorted(errors)
        parts = []
        for r in culprits + [r for r in sorted(errors) if r not in culprits]:
            pid = self._chans[r].pid if r < len(self._chans) and self._chans[r] is not None else "?"
            first, _, rest = errors[r].strip().partition("\n")
            if rest:  # e.g. a collective's traceback: the first line names it, the log keeps the rest
                logger.error("rank %d (pid %s) %s", r, pid, errors[r])
                first += " (details in the log)"
            parts.append(f"rank {r} (pid {pid}) {first}")
        head = f"deepinfer parallel engine failed: {'; '.join(parts) or note}"
        if note and parts:
            head += f" ({note})"
        self._failure = WorkerFailure(head.rstrip(), culprits)
        logger.error("%s", self._failure)
        self._kill_all(force=True)  # nothing left to save: a stopped or wedged rank ignores SIGTERM
        self._fail_requests(self._failure)
        return self._failure

    def _kill_all(self, grace_s: float = 0.0, force: bool = False) -> None:
        _reap(self._procs, grace_s, force)
        for ch in self._chans:
            if isinstance(ch, _Remote):
                for conn in (ch.conn, ch.probe):
                    try:
                        conn.close()
                    except OSError:
                        pass

    def worker_pids(self) -> list[int]:
        return [ch.pid for ch in self._chans]
