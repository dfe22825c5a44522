"""The wire between the API process and the engine core: length-prefixed JSON frames on a socket.

JSON, not pickle: a frame read from the socket can only ever become plain lists, dicts, strings
and numbers, whatever wrote it. Each frame is a 4-byte big-endian length and a UTF-8 JSON document.
Python's ``json`` writes ``-Infinity`` for a ``-inf`` logprob and reads it back.

The encoders below turn the few objects that cross the wire (sampling parameters, logprobs, a
finished request's :class:`RequestOutput`, an error) into compact lists and back.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import select
import socket
import struct

from deepinfer_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer_core.sampling_params import SamplingParams

_HEADER = struct.Struct(">I")
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_decode = json.JSONDecoder().decode


class Channel:
    """One end of a socket carrying JSON frames. ``send`` may be called from one thread while
    another reads; ``recv`` and ``poll`` must be called from a single reading thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._eof = False

    def send(self, message) -> None:
        data = _encode(message).encode()
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _frames(self) -> list:
        out, buf = [], self._buf
        while len(buf) >= 4:
            (n,) = _HEADER.unpack_from(buf)
            if len(buf) < 4 + n:
                break
            out.append(_decode(buf[4 : 4 + n].decode()))
            del buf[: 4 + n]
        return out

    def recv(self) -> list:
        """Block until at least one whole frame arrives; all whole frames read. EOFError when closed."""
        while True:
            frames = self._frames()
            if frames:
                return frames
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the other end closed the channel")
            self._buf += chunk

    def poll(self) -> list:
        """The whole frames that can be read now without blocking (possibly none). EOFError once
        the other end has closed and every frame it sent has been returned."""
        while not self._eof and select.select([self.sock], [], [], 0)[0]:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                self._eof = True
                break
            self._buf += chunk
        frames = self._frames()
        if self._eof and not frames:
            raise EOFError("the other end closed the channel")
        return frames

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ---- sampling parameters ----------------------------------------------------------------------------
def params_to_wire(params: SamplingParams | dict | None) -> dict | None:
    if params is None or isinstance(params, dict):
        return params
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


# ---- logprobs ----------------------------------------------------------------------------------------
def logprobs_to_wire(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in e.items()]
            for e in entries]


def logprobs_from_wire(entries: list | None) -> list[dict[int, Logprob] | None] | None:
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(lp, rank, text) for t, lp, rank, text in e} for e in entries]


# ---- errors --------------------------------------------------------------------------------------------
def error_to_wire(exc: BaseException | None) -> list | None:
    """``[class name, message, nearest built-in class name]``."""
    if exc is None:
        return None
    base = next(c for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c)
    return [type(exc).__name__, str(exc), base.__name__]


def error_from_wire(err: list | None) -> BaseException | None:
    """An exception of the nearest built-in class (a plugin's GrammarError stays a ValueError) with
    the same message; ConfigError and EngineDrainingError are rebuilt as themselves. Where the
    built-in class says little (RuntimeError, Exception), the message keeps the original class name."""
    if err is None:
        return None
    name, message, base = err
    if name == "ConfigError":
        from deepinfer_core.config import ConfigError

        return ConfigError(message)
    if name == "EngineDrainingError":  # a 503 (send it elsewhere), not a 400
        from deepinfer_core.engine.engine import EngineDrainingError

        return EngineDrainingError(message)
    cls = getattr(builtins, base, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    if name != cls.__name__ and cls in (Exception, RuntimeError):
        message = f"{name}: {message}"
    return cls(message)


# ---- a finished request's output ---------------------------------------------------------------------
def output_to_wire(out: RequestOutput) -> list:
    completions = [[c.index, c.text, c.token_ids, logprobs_to_wire(c.logprobs), c.finish_reason, c.stop_reason,
                    c.cumulative_logprob, c.kv_transfer_params] for c in out.outputs]
    return [out.request_id, out.prompt, out.prompt_token_ids, logprobs_to_wire(out.prompt_logprobs), completions,
            out.finished, dataclasses.asdict(out.metrics), error_to_wire(out.error), out.kv_transfer_params]


def output_from_wire(w: list) -> RequestOutput:
    rid, prompt, prompt_ids, prompt_lps, completions, finished, metrics, error, transfer = w
    outs = [CompletionOutput(i, text, ids, logprobs_from_wire(lps), reason, stop, cum, transfer_i)
            for i, text, ids, lps, reason, stop, cum, transfer_i in completions]
    return RequestOutput(rid, prompt, prompt_ids, logprobs_from_wire(prompt_lps), outs, finished,
                         RequestMetrics(**metrics), error_from_wire(error), transfer)
