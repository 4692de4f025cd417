"""Native encoder-decoder models, chosen by the checkpoint's ``architectures``.

    cls = get_model_class(hf_config)
    model = cls(hf_config, backend)
"""
from __future__ import annotations

from enc2dec.engine.models.bart import BartForConditionalGeneration, MBartForConditionalGeneration
from enc2dec.engine.models.t5 import T5ForConditionalGeneration
from enc2dec.engine.models.whisper import WhisperForConditionalGeneration

ARCHITECTURES = {
    "T5ForConditionalGeneration": T5ForConditionalGeneration,
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "MBartForConditionalGeneration": MBartForConditionalGeneration,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
}

# Old or hand-written configs may lack ``architectures``; the model type then decides.
_BY_MODEL_TYPE = {
    "t5": "T5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration",
    "whisper": "WhisperForConditionalGeneration",
}


def get_model_class(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _BY_MODEL_TYPE:
        return ARCHITECTURES[_BY_MODEL_TYPE[model_type]]
    found = ", ".join(archs) if archs else f"none (model_type={model_type!r})"
    raise ValueError(f"architecture {found} is not supported; supported architectures: "
                     f"{', '.join(ARCHITECTURES)}")


__all__ = ["ARCHITECTURES", "get_model_class"]
