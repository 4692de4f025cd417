"""transformers' own models as the reference the engine is checked against."""
from __future__ import annotations

import json

import torch


def hf_whisper(path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """WhisperForConditionalGeneration from ``path`` with the generation-config keys that
    transformers 5.x drops on load (lang_to_id, task_to_id, is_multilingual) put back."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(str(path), dtype=dtype).to(device).eval()
    with open(f"{path}/generation_config.json") as f:
        for key, value in json.load(f).items():
            if not hasattr(model.generation_config, key):
                setattr(model.generation_config, key, value)
    return model
