"""toyaccel: an example DeepInfer accelerator plugin that runs on the CPU.

It shows the whole surface a hardware vendor implements: a :class:`~deepinfer_core.platform.Platform`
(``deepinfer.hardware`` entry point) and a :class:`~deepinfer_core.kernels.KernelBackend`
(``deepinfer.kernels`` entry point) that overrides a few ops and leaves the rest to the reference.
"""

__version__ = "0.1.0"
