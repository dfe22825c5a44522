"""Plugin discovery, accelerator selection and kernel resolution, through real entry points.

Broken and mismatched plugins are real distributions: a package plus a ``*.dist-info`` with
``entry_points.txt`` written to a temporary directory that is put on ``sys.path``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest
import torch
from stevedore import ExtensionManager
from stevedore import _cache as stevedore_cache

from deepinfer_core import plugins
from deepinfer_core.kernels import OP_NAMES, KernelBackend, Kernels
from deepinfer_core.platform import Platform
from deepinfer_core.selection import AcceleratorError, select_platform
from deepinfer_core.version import PluginAPIVersionError
from hardware.ascend import AscendPlatform
from hardware.cpu import CpuPlatform
from hardware.nvidia import NvidiaPlatform
from kernels_ascend import AscendKernels
from kernels_cpu import ReferenceKernels
from kernels_cuda import CudaKernels

HW = "deepinfer.hardware"
DIST = "deepinfer-testplugs"


def forget_entry_points(monkeypatch, tmp_path) -> None:
    """stevedore caches entry points per group in a class dict, and on disk keyed by sys.path: a
    distribution put on sys.path by a test is seen only with both caches fresh."""
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    monkeypatch.setattr(stevedore_cache._c, "_dir", str(tmp_path / "entry-point-cache"))


@pytest.fixture(autouse=True)
def fresh_entry_point_cache(monkeypatch, tmp_path):
    forget_entry_points(monkeypatch, tmp_path)
    yield


PLUGIN_MODULES = {
    "dit_broken_hw": """
        raise RuntimeError("libtoy.so: cannot open shared object file")
    """,
    "dit_oldapi_hw": """
        from deepinfer_core.platform import Availability, Platform

        class OldPlatform(Platform):
            name = "oldapi"
            core_api_version = "2.0"

            @classmethod
            def probe(cls):
                return Availability.yes()

            def device_count(self):
                return 1

            def memory_info(self, index=0):
                return (1, 1)
    """,
    "dit_fast_hw": """
        from deepinfer_core.platform import Availability, Platform

        class FastPlatform(Platform):
            name = "fastfake"
            core_api_version = "1.0"
            probe_priority = 50

            @classmethod
            def probe(cls):
                return Availability.yes()

            def device_count(self):
                return 1

            def memory_info(self, index=0):
                return (1, 1)
    """,
}


def make_distribution(root, entry_points: str, modules: dict[str, str], dist: str = DIST) -> None:
    """Write importable modules and a dist-info that registers ``entry_points`` into ``root``."""
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Install (onto sys.path) a distribution with a broken, an old-API and a fast fake platform."""
    site = tmp_path / "site"
    site.mkdir()
    make_distribution(site, """
        [deepinfer.hardware]
        broken = dit_broken_hw:Whatever
        oldapi = dit_oldapi_hw:OldPlatform
        fastfake = dit_fast_hw:FastPlatform
    """, PLUGIN_MODULES)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield site
    for mod in PLUGIN_MODULES:
        sys.modules.pop(mod, None)


# ---- discovery ----------------------------------------------------------------------------
def test_in_tree_plugins_are_discovered_with_their_distribution():
    hw = {p.name: p for p in plugins.discover(HW)}
    assert {"cpu", "nvidia", "ascend"} <= set(hw)
    classes = (hw["cpu"].obj, hw["nvidia"].obj, hw["ascend"].obj)
    assert classes == (CpuPlatform, NvidiaPlatform, AscendPlatform)
    for name in ("cpu", "nvidia", "ascend"):
        assert hw[name].error is None
        assert (hw[name].distribution, hw[name].version) == ("deepinfer", "0.1.0")
    assert hw["cpu"].target == "hardware.cpu:CpuPlatform"

    kernels = {p.name: p for p in plugins.discover("deepinfer.kernels")}
    assert kernels["reference"].obj is ReferenceKernels
    assert kernels["cuda"].obj is CudaKernels
    assert kernels["ascend"].obj is AscendKernels
    assert ReferenceKernels.overrides() == list(OP_NAMES)
    assert set(CudaKernels.overrides()) <= set(OP_NAMES)
    assert AscendKernels.overrides() == [
        "rms_norm", "add_rms_norm", "silu_and_mul", "rope", "paged_kv_write", "paged_kv_gather", "mla_decode",
        "mla_prefill", "moe_route", "fused_moe", "rope_inverse", "v4_compress", "moe_route_v4",
        "silu_and_mul_clamped", "fused_moe_clamped", "sample"]


def test_installed_names_does_not_import(third_party):
    names = plugins.installed_names(HW)
    assert {"cpu", "nvidia", "ascend", "broken", "oldapi", "fastfake"} <= set(names)
    assert names == sorted(names)
    assert not {"dit_broken_hw", "dit_oldapi_hw", "dit_fast_hw"} & set(sys.modules)
    assert "host" in plugins.installed_names("deepinfer.kv_stores")


def test_load_by_name():
    assert plugins.load(HW, "cpu") is CpuPlatform
    assert plugins.load("deepinfer.kernels", "reference") is ReferenceKernels


def test_load_unknown_lists_installed():
    with pytest.raises(plugins.PluginNotFoundError) as info:
        plugins.load("deepinfer.kernels", "nope", what="kernel backend")
    installed = ", ".join(plugins.installed_names("deepinfer.kernels"))
    assert str(info.value) == (f"unknown kernel backend 'nope': no entry point named 'nope' in group "
                               f"'deepinfer.kernels'; installed: {installed}")


# ---- selection ----------------------------------------------------------------------------
def test_select_cpu_by_name_and_by_env(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.selection")
    p = select_platform("cpu")
    assert isinstance(p, CpuPlatform) and p.device() == torch.device("cpu")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", " CPU ")
    assert isinstance(select_platform(), CpuPlatform)
    assert [r.getMessage() for r in caplog.records] == ["accelerator 'cpu' selected by name"] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_auto_selection_logs_every_rejection(monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    caplog.set_level(logging.INFO, logger="deepinfer.selection")
    platform = select_platform()
    assert platform.name == "cpu"
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"accelerator 'nvidia' rejected: {NvidiaPlatform.probe().reason}",
        f"accelerator 'ascend' rejected: {AscendPlatform.probe().reason}",
        "accelerator 'cpu' selected by auto-detection",
    ]
    assert "CUDA" in NvidiaPlatform.probe().reason


def test_auto_equals_explicit_auto(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "auto")
    assert type(select_platform()) is type(select_platform("auto"))


def test_unknown_accelerator_lists_installed():
    with pytest.raises(AcceleratorError) as info:
        select_platform("tpu9000")
    installed = plugins.installed_names(HW)
    assert {"ascend", "cpu", "nvidia"} <= set(installed)
    assert str(info.value) == ("unknown accelerator 'tpu9000': no entry point named 'tpu9000' in group "
                               f"'deepinfer.hardware'; installed: {', '.join(installed)}")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_ascend_without_torch_npu():
    with pytest.raises(AcceleratorError) as info:
        select_platform("ascend")
    installed = ", ".join(plugins.installed_names(HW))
    assert str(info.value) == ("accelerator 'ascend' is not available: torch_npu is not installed "
                               "(pip install torch-npu, with Ascend CANN). "
                               f"Installed accelerators: {installed}")
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_nvidia_without_cuda():
    with pytest.raises(AcceleratorError) as info:
        select_platform("nvidia")
    reason = NvidiaPlatform.probe().reason
    assert reason in (f"this torch build ({torch.__version__}) has no CUDA support",
                      "no CUDA device is visible (torch.cuda.device_count() == 0)")
    installed = ", ".join(plugins.installed_names(HW))
    assert str(info.value) == (f"accelerator 'nvidia' is not available: {reason}. "
                               f"Installed accelerators: {installed}")


def test_broken_plugin_names_itself_and_chains_the_error(third_party):
    with pytest.raises(AcceleratorError) as info:
        select_platform("broken")
    installed = ", ".join(plugins.installed_names(HW))
    assert "broken" in installed and "oldapi" in installed
    assert str(info.value) == (
        "accelerator 'broken' cannot be loaded: accelerator 'broken' (group 'deepinfer.hardware') is "
        "installed but failed to import: RuntimeError: libtoy.so: cannot open shared object file. "
        f"Installed accelerators: {installed}"
    )
    cause = info.value.__cause__
    assert isinstance(cause, plugins.PluginError)
    assert isinstance(cause.__cause__, RuntimeError)
    assert str(cause.__cause__) == "libtoy.so: cannot open shared object file"


def test_plugin_for_another_core_api_is_refused(third_party):
    with pytest.raises(AcceleratorError) as info:
        select_platform("oldapi")
    assert str(info.value).startswith(
        "accelerator 'oldapi' cannot be loaded: accelerator 'oldapi' was written for core API 2.0, but this "
        "core provides 1.0 (needs the same major version and a minor version <= 0). Installed accelerators: "
    )
    assert isinstance(info.value.__cause__, PluginAPIVersionError)
    with pytest.raises(PluginAPIVersionError) as direct:
        plugins.load(HW, "oldapi", what="accelerator")
    assert str(direct.value) == ("accelerator 'oldapi' was written for core API 2.0, but this core provides "
                                 "1.0 (needs the same major version and a minor version <= 0)")


@pytest.mark.parametrize("version,ok", [("1.0", True), ("1.1", False), ("0.9", False), ("2.0", False),
                                        ("1", False), (None, False)])
def test_api_version_rules(version, ok):
    from deepinfer_core.version import check_api_version

    obj = type("P", (), {} if version is None else {"core_api_version": version})
    if ok:
        check_api_version(obj, "plugin p")
    else:
        with pytest.raises(PluginAPIVersionError, match="^plugin p"):
            check_api_version(obj, "plugin p")


def test_discover_reports_broken_plugins_instead_of_raising(third_party):
    hw = {p.name: p for p in plugins.discover(HW)}
    assert {"broken", "oldapi", "fastfake", "cpu"} <= set(hw)
    broken, old, fast = hw["broken"], hw["oldapi"], hw["fastfake"]
    assert (broken.distribution, broken.version, broken.target) == (DIST, "0.1", "dit_broken_hw:Whatever")
    assert broken.obj is None and isinstance(broken.error, RuntimeError)
    assert old.obj is not None and isinstance(old.error, PluginAPIVersionError)
    assert str(old.error).startswith("plugin 'oldapi' in deepinfer.hardware was written for core API 2.0")
    assert fast.error is None and (fast.distribution, fast.version) == (DIST, "0.1")


def test_auto_selection_skips_broken_and_prefers_lower_priority(third_party, monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    caplog.set_level(logging.INFO, logger="deepinfer.selection")
    platform = select_platform()
    assert platform.name == "fastfake"  # priority 50: before the cpu (1000)
    messages = [r.getMessage() for r in caplog.records]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "accelerator 'broken' rejected: failed to load: libtoy.so: cannot open shared object file",
        "accelerator 'oldapi' rejected: failed to load: plugin 'oldapi' in deepinfer.hardware was written "
        "for core API 2.0, but this core provides 1.0 (needs the same major version and a minor version "
        "<= 0)",
    ]
    assert messages[-1] == "accelerator 'fastfake' selected by auto-detection"
    assert "accelerator 'cpu' selected by auto-detection" not in messages


def test_entry_points_are_rescanned_after_the_fixture(third_party):
    assert "broken" in plugins.installed_names(HW)


def test_throwaway_plugins_are_gone_again():
    assert not {"broken", "oldapi", "fastfake"} & set(plugins.installed_names(HW))


# ---- kernels ------------------------------------------------------------------------------
def test_kernels_fall_back_to_the_reference_and_log_it(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.kernels")
    k = Kernels(AscendKernels, ReferenceKernels)
    assert k.backend_name == "ascend"
    v4 = ["v4_indexer_topk", "v4_sparse_attention", "mhc_pre", "mhc_post", "mhc_head"]  # docs/ascend.md: no fused op
    mxfp8 = ["ue8m0_scale", "mxfp8_quant", "mxfp8_dequant"]  # window KV snapshots: host-bound, reference
    fp8 = ["fp8_linear", "fused_moe_fp8"]  # block-scaled FP8 weights: no Ascend kernel yet
    spec = ["draft_lengths"]  # speculative draft lengths: the torch reference on the device
    # decode-fusion compositions: the reference (planes unfused)
    fused = ["linear_f32", "add_rms_norm_linear", "mla_kv_write", "mla_q_absorb", "mla_q_absorb_kv_write",
             "mla_decode_uv", "moe_gate", "add_rms_norm_moe_gate"]
    kv8 = ["latent_kv_dequant"]  # FP8 latent KV rows: the platform does not list kv_cache_dtype "fp8"
    expected = ["linear", "head_linear", *kv8, *fused, *fp8, *v4, "apply_penalties", *mxfp8, *spec, "logsumexp",
                "greedy_sample"]
    assert k.fallbacks == expected
    assert [r.getMessage() for r in caplog.records] == [
        f"kernel backend 'ascend' has no {', '.join(expected)}; using the reference ops"
    ]
    import kernels_ascend.dense
    import kernels_cpu.ops

    assert k.rms_norm is kernels_ascend.dense.rms_norm
    assert k.linear is kernels_cpu.ops.linear
    assert "torch_npu" not in sys.modules  # resolving ops imports torch_npu only when they run


def test_reference_kernels_have_no_fallbacks_and_an_empty_backend_falls_back_entirely():
    assert Kernels(ReferenceKernels, ReferenceKernels).fallbacks == []
    empty = type("Empty", (KernelBackend,), {"name": "empty", "core_api_version": "1.0", "ops": {}})
    k = Kernels(empty, ReferenceKernels)
    assert k.fallbacks == list(OP_NAMES) and k.backend_name == "empty"


def test_kernels_override_and_unknown_names():
    k = Kernels(ReferenceKernels, ReferenceKernels)
    k.override("linear", lambda x, w, b=None: "mine")
    assert k.linear(None, None) == "mine"
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        k.override("nope", print)
    with pytest.raises(AttributeError, match="no kernel op named 'nope'"):
        k.nope  # noqa: B018


def test_backend_naming_an_unknown_op_is_an_error():
    class Typo(KernelBackend):
        name = "typo"
        core_api_version = "1.0"
        ops = {"rms_norm": "x:y", "rmsnorm": "x:z"}

    with pytest.raises(ValueError, match=r"kernel backend 'typo' names unknown ops \['rmsnorm'\]"):
        Typo.overrides()


def test_platform_defaults():
    p = CpuPlatform()
    assert p.describe() == {"device_type": "cpu", "dist_backend": "gloo", "kernel_backend": "reference",
                            "graph_capture": False, "graph_capture_dtypes": [], "pinned_memory": False,
                            "async_overlap": False, "fp8_gemm": False, "kv_cache_dtypes": ["auto", "bf16", "fp8"]}
    free, total = p.memory_info()
    assert 0 < free <= total
    assert p.stream() is None and not p.supports_graph_capture()
    with pytest.raises(NotImplementedError, match="platform 'cpu' does not support graph capture"):
        p.graph()
    a, b = p.event(), p.event()
    a.record()
    b.record()
    assert b.elapsed_time(a) <= 0 <= a.elapsed_time(b)
    assert issubclass(CpuPlatform, Platform)
