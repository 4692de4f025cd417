"""enc2dec engine: the TensorRT-LLM-style LLM API over a paged-KV encoder-decoder engine.

    from enc2dec.engine import LLM, SamplingParams, KvCacheConfig
"""
from enc2dec.engine.config import (CudaGraphConfig, EncodeCudaGraphConfig, KvCacheConfig, LlmArgs, SchedulerConfig,
                                   TuningConfig)
from enc2dec.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from enc2dec.engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in torch and transformers; keep `import enc2dec.engine` light for the CLI's --help.
    if name in ("LLM", "RequestHandle"):
        from enc2dec.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'enc2dec.engine' has no attribute {name!r}")


__all__ = [
    "LLM", "RequestHandle", "SamplingParams", "KvCacheConfig", "SchedulerConfig", "CudaGraphConfig",
    "EncodeCudaGraphConfig", "TuningConfig", "LlmArgs", "RequestOutput", "CompletionOutput", "RequestMetrics",
]
