"""Finds a checkpoint's config, generation config, tokenizer and feature extractor.

``model`` is a local Hugging Face folder, a hub id (downloaded where the hub is reachable),
or, with ``load_format="dummy"``, the name of a well-known model in our config table.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("enc2dec")


@dataclass
class ModelSource:
    path: str | None               # local folder with weights (None for dummy known configs)
    hf_config: Any
    generation_config: Any
    tokenizer: Any
    feature_extractor: Any = None


def _generation_config(path, hf_config):
    from transformers import GenerationConfig

    if path is not None:
        try:
            gen = GenerationConfig.from_pretrained(path)
        except (OSError, ValueError):
            return GenerationConfig.from_model_config(hf_config)
        # transformers 5 drops Whisper's keys (is_multilingual, lang_to_id, ...) from the
        # object; the decoder prefix rules need them, so restore them from the file.
        raw_path = os.path.join(path, "generation_config.json")
        if os.path.exists(raw_path):
            with open(raw_path) as f:
                for key, value in json.load(f).items():
                    if not hasattr(gen, key):
                        setattr(gen, key, value)
        return gen
    return GenerationConfig.from_model_config(hf_config)


def _tokenizer(tokenizer, path, trust_remote_code: bool = False):
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    source = tokenizer or path
    if source is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - tokenizers fail in many ways; text prompts then need one
        if tokenizer is not None:
            raise ValueError(f"cannot load the tokenizer from {tokenizer}: {e}") from None
        logger.warning("no tokenizer loaded from %s (%s); prompts must be token ids", source, e)
        return None


def _feature_extractor(path, hf_config):
    from transformers import WhisperFeatureExtractor

    if path is not None:
        try:
            return WhisperFeatureExtractor.from_pretrained(path)
        except (OSError, ValueError):
            pass
    return WhisperFeatureExtractor(feature_size=hf_config.num_mel_bins)


def resolve_model(model: str, tokenizer=None, load_format: str = "auto", trust_remote_code: bool = False) -> ModelSource:
    """``trust_remote_code`` lets transformers run a checkpoint's own config and tokenizer code
    (its model code is never run: the model classes are this engine's)."""
    from transformers import AutoConfig

    from enc2dec.engine.inputs.known_configs import KNOWN_MODELS, get_known_config, get_known_generation_config

    path, gen = None, None
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ValueError(f"{model} is a folder without config.json; point at a Hugging Face checkpoint folder")
        path = model
        hf_config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    elif load_format == "dummy" and model in KNOWN_MODELS:
        hf_config = get_known_config(model)
        gen = get_known_generation_config(model)
    else:
        try:
            hf_config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - hub errors are many; the message is what matters
            known = ", ".join(KNOWN_MODELS)
            raise ValueError(f"cannot load model {model!r}: not a local folder, and the hub gave: {e}. "
                             f"With load_format='dummy' these names need no download: {known}") from None
        if load_format != "dummy":
            from huggingface_hub import snapshot_download

            path = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model",
                                                            "*.txt", "*.tiktoken"])
    tok = _tokenizer(tokenizer, path, trust_remote_code)
    gen = gen or _generation_config(path, hf_config)
    fe = _feature_extractor(path, hf_config) if hf_config.model_type == "whisper" else None
    return ModelSource(path, hf_config, gen, tok, fe)
