"""An emulated ``torch_npu`` for CPU tests (never shipped, never evidence of NPU speed).

Built from the pinned schemas (kernels_ascend/schemas): every call is bound against the op's schema
exactly as the real dispatcher would (unknown keywords, extra positionals, missing required
arguments and wrong argument kinds raise ``TypeError`` naming the op and the argument), enum
arguments are checked against the values the docs allow, and then

* the ops kernels_ascend uses run their documented semantics in plain torch (``ops.py``, each citing
  its section of ``torch_npu/_op_plugin_docs.py``), enforcing the documented dtype, layout and size
  constraints they rely on;
* any other torch_npu op raises ``NotImplementedError``, and a name torch_npu does not have raises
  ``AttributeError``.

``install()`` puts it in ``sys.modules`` as ``torch_npu`` (and ``torch_npu.npu``) for the duration of
a ``with`` block.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections import Counter
from contextlib import contextmanager

import torch

from kernels_ascend.schemas import OpSchema, Param, Schemas, load

from . import ops as _ops

_NOT_GIVEN = object()


def _kind_error(p: Param, value: object) -> str | None:
    """Why ``value`` cannot be passed for ``p`` (None when it can)."""
    typ = p.type.replace("(a!)", "").replace("(b!)", "")
    optional = typ.endswith("?")
    typ = typ.rstrip("?")
    if value is None:
        return None if optional else "None for a non-optional parameter"
    if typ == "Tensor":
        return None if isinstance(value, torch.Tensor) else f"{type(value).__name__}, expected a Tensor"
    if typ == "Tensor[]":
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)
        return None if ok else f"{type(value).__name__}, expected a list of Tensors"
    if typ.startswith(("int[", "SymInt[")):
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return None if ok else (f"{type(value).__name__}, expected a list of Python ints (a host list: "
                                "the op reads it on the host)")
    if typ in ("int", "SymInt"):
        return None if isinstance(value, int) and not isinstance(value, bool) else \
            f"{type(value).__name__}, expected an int"
    if typ == "float":
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            f"{type(value).__name__}, expected a float"
    if typ == "bool":
        return None if isinstance(value, bool) else f"{type(value).__name__}, expected a bool"
    if typ == "str":
        return None if isinstance(value, str) else f"{type(value).__name__}, expected a str"
    return None  # ScalarType and friends: not checked


def bind(schema: OpSchema, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by parameter name, defaults filled in; TypeError naming the problem."""
    op = f"torch_npu.{schema.name}"
    positional = schema.positional
    if len(args) > len(positional):
        raise TypeError(f"{op}() takes at most {len(positional)} positional argument(s), got {len(args)}")
    bound = {p.name: a for p, a in zip(positional, args)}
    names = {p.name for p in schema.params}
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{op}() got an unexpected keyword argument {k!r}")
        if k in bound:
            raise TypeError(f"{op}() got multiple values for argument {k!r}")
        bound[k] = v
    for p in schema.params:
        if p.name not in bound:
            if p.required:
                raise TypeError(f"{op}() missing required argument {p.name!r}")
            bound[p.name] = p.default
        err = _kind_error(p, bound[p.name])
        if err:
            raise TypeError(f"{op}() argument {p.name!r}: {err}")
    return bound


def _check_enums(schemas: Schemas, schema: OpSchema, bound: dict) -> None:
    for name, value in bound.items():
        enum = schemas.enums.get(f"{schema.name}.{name}")
        if enum is not None and value not in enum["values"]:
            raise ValueError(f"torch_npu.{schema.name}() argument {name!r}={value!r} is not one of "
                             f"{enum['values']} (docs: {enum['doc']!r})")


#: Ops whose launches an ``auto_dispatch_capture`` capture records, and the host arguments
#: ``NPUGraph.update`` may rewrite (torch_npu/npu/_npugraph_handlers/ifa_handler.py, UPDATE_SPECS)
GRAPH_UPDATABLE = {"npu_fused_infer_attention_score_v2": ("actual_seq_qlen", "actual_seq_kvlen")}


class EmulatedNPUGraph:
    """``torch_npu.npu.NPUGraph`` as far as it can be emulated on the CPU: nothing is captured but the
    launches of :data:`GRAPH_UPDATABLE` ops (when captured with ``auto_dispatch_capture``), which
    ``update`` rewrites and ``replay`` re-runs into their recorded outputs, as torch_npu/npu/graphs.py
    documents (``_GraphDispatchMode``: capture records each handled launch with a preallocated output;
    ``update_capture_record``: one dict is copied for every record, else one per record in launch
    order; a key only replaces the recorded argument of that name). Not evidence that the rest of a
    decode step can be captured on an NPU."""

    def __init__(self) -> None:
        self.auto_dispatch_capture = False
        self.records: list[tuple[str, dict, tuple]] = []  # (op, bound arguments, recorded outputs)
        self.replays = 0

    def pool(self) -> tuple:
        return ()

    def update(self, cpu_update_input: list[dict]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update,Try to capture by setting "
                               "auto_dispatch_capture=True during capture")
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in self.records]
        if len(cpu_update_input) != len(self.records):
            raise RuntimeError(f"Currently, there are {len(self.records)} operators that need to be updated by "
                               f"capture, and there are only {len(cpu_update_input)} elements in the incoming "
                               "cpu_update_input list")
        for (op, bound, _), new in zip(self.records, cpu_update_input):
            for key, value in new.items():
                if key in GRAPH_UPDATABLE[op]:
                    bound[key] = value

    def replay(self) -> None:
        for op, bound, outs in self.records:
            for out, new in zip(outs, _ops.IMPLEMENTED[op](**bound)):
                out.copy_(new)
        self.replays += 1


class EmulatedNpu(types.ModuleType):
    """``torch_npu.npu``: the runtime queries the kernels make and the graph API (as far as
    :class:`EmulatedNPUGraph` goes); the rest of ``__all__`` raises."""

    def __init__(self, schemas: Schemas) -> None:
        super().__init__("torch_npu.npu")
        self._names = schemas.modules["torch_npu.npu"]
        self.capturing = False  # tests set it to exercise the capture-time dispatch
        self.recording: EmulatedNPUGraph | None = None  # the graph an auto-dispatch capture records into
        self.NPUGraph = EmulatedNPUGraph

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    @contextmanager
    def graph(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        if self.capturing:
            raise RuntimeError("a capture is already underway")
        npu_graph.auto_dispatch_capture = auto_dispatch_capture
        self.capturing, self.recording = True, npu_graph if auto_dispatch_capture else None
        try:
            yield
        finally:
            self.capturing, self.recording = False, None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._names:
            raise NotImplementedError(f"torch_npu.npu.{name} is not emulated on the CPU")
        raise AttributeError(f"module 'torch_npu.npu' has no attribute {name!r}")


class EmulatedTorchNpu(types.ModuleType):
    def __init__(self, schemas: Schemas | None = None) -> None:
        super().__init__("torch_npu")
        self.__file__ = __file__
        self._schemas = schemas or load()
        self.npu = EmulatedNpu(self._schemas)
        self.calls: Counter[str] = Counter()
        #: the bound arguments of every completed launch of a GRAPH_UPDATABLE op, in order
        self.launches: list[tuple[str, dict]] = []
        self._impls = {}
        for name, fn in _ops.IMPLEMENTED.items():
            schema = self._schema_for(name, fn)
            self._impls[name] = (schema, fn)

    def _schema_for(self, name: str, fn) -> OpSchema:
        """The overload whose parameters are exactly the implementation's (checked at import)."""
        overloads = self._schemas.ops.get(name)
        if not overloads:
            raise RuntimeError(f"emulation implements {name!r}, which torch_npu {self._schemas.version} lacks")
        want = list(inspect.signature(fn).parameters)
        for s in overloads:
            if [p.name for p in s.params] == want:
                return s
        raise RuntimeError(f"emulated {name}{want} matches no schema of torch_npu {self._schemas.version}: "
                           f"{[s.text for s in overloads]}")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.__dict__.get("_impls", {}):
            schema, fn = self._impls[name]

            def op(*args, **kwargs):
                bound = bind(schema, args, kwargs)
                _check_enums(self._schemas, schema, bound)
                out = fn(**bound)
                self.calls[name] += 1  # completed calls only
                if name in GRAPH_UPDATABLE:
                    self.launches.append((name, bound))
                    if self.npu.recording is not None:
                        self.npu.recording.records.append((name, bound, out))
                return out

            op.__name__ = name
            op.__doc__ = fn.__doc__
            return op
        if name in self._schemas.ops:
            raise NotImplementedError(f"torch_npu.{name} is not emulated on the CPU (kernels_ascend does not use it)")
        raise AttributeError(f"module 'torch_npu' ({self._schemas.version}) has no attribute {name!r}")


@contextmanager
def install():
    """Make ``import torch_npu`` return a fresh emulation inside the block; yields it."""
    saved = {k: sys.modules.get(k) for k in ("torch_npu", "torch_npu.npu")}
    emu = EmulatedTorchNpu()
    sys.modules["torch_npu"], sys.modules["torch_npu.npu"] = emu, emu.npu
    try:
        yield emu
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
