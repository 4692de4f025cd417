"""transformers' own models as the reference the engine is checked against."""
from __future__ import annotations

import torch
from enc2dec.engine.inputs.hf_reference import load_hf_model
from enc2dec.engine.inputs.model_source import resolve_model


def hf_whisper(path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """WhisperForConditionalGeneration from ``path``, loaded as bench and eval load their
    reference, so its generation config keeps the keys transformers 5.x drops on load
    (lang_to_id, task_to_id, is_multilingual) and the checkpoint's own decoding settings."""
    return load_hf_model(resolve_model(str(path)), device, dtype).model
