"""DeepInfer core: interfaces, engine, DeepSeek models and the public API.

    from deepinfer_core import LLM, SamplingParams
"""

from deepinfer_core.version import CORE_API_VERSION

__all__ = ["CORE_API_VERSION", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # Lazy so that `import deepinfer_core` (e.g. by `deepinfer plugins`) stays light.
    if name == "LLM":
        from deepinfer_core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer_core.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from deepinfer_core import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
