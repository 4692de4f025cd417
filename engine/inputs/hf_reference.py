"""transformers' own model for a checkpoint, set to decode as the engine does.

What bench's baselines, eval's reference and the tests share: the model class for the
checkpoint (``AutoModelForSeq2SeqLM`` / ``AutoModelForSpeechSeq2Seq``) on a device and
dtype, a generation config with everything the engine does not do switched off, batches
of encoder inputs, and a synchronised ``generate``. It sits beside ``model_source``
because it reads the checkpoint the same way (the restored Whisper generation keys
included), and in the engine because bench and eval may import only the engine.
torch and transformers load when a model does, not at import.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from enc2dec.engine.inputs.model_source import ModelSource

# generation-config keys and the values that make transformers decode as the engine does
_NEUTRAL = {
    "do_sample": False, "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "min_length": 0, "min_new_tokens": None,
    "forced_eos_token_id": None, "bad_words_ids": None, "early_stopping": False, "max_length": None,
    "temperature": None, "top_k": None, "top_p": None, "typical_p": None, "diversity_penalty": None,
    "exponential_decay_length_penalty": None, "sequence_bias": None, "renormalize_logits": False,
}
# overridden settings worth telling the user about (the rest are sampling knobs greedy ignores)
_NOTEWORTHY = ("num_beams", "no_repeat_ngram_size", "repetition_penalty", "length_penalty", "min_length",
               "forced_eos_token_id", "do_sample", "encoder_no_repeat_ngram_size")


def engine_generation_config(gen, hf_config, num_beams: int = 1) -> tuple[Any, list[str]]:
    """A copy of ``gen`` that decodes greedily (or with ``num_beams`` beams, length_penalty 1.0,
    early_stopping False: the engine's defaults) with no sampling, n-gram blocking, penalties,
    minimum lengths or forced EOS. Returns it and notes, for the user, on what the
    checkpoint's own settings were and what else had to change."""
    gen = copy.deepcopy(gen)
    overridden = []
    for key, neutral in _NEUTRAL.items():
        old = getattr(gen, key, None)
        if key in _NOTEWORTHY and old not in (None, neutral, 0, 1.0, False):
            overridden.append(f"{key}={old}")
        setattr(gen, key, neutral)
    if hf_config.model_type != "whisper":      # the engine applies token suppression to Whisper only
        for key in ("suppress_tokens", "begin_suppress_tokens"):
            if getattr(gen, key, None):
                overridden.append(f"{key}={getattr(gen, key)}")
            setattr(gen, key, None)
    gen.num_beams = num_beams
    how = "greedily" if num_beams == 1 else f"with num_beams={num_beams}"
    notes = [(f"the checkpoint's generation config sets {', '.join(overridden)}; both sides decode {how} "
              "without them")] if overridden else []
    if hf_config.model_type == "t5" and (hf_config.num_decoder_layers or hf_config.num_layers) != \
            hf_config.num_layers:
        # transformers 5.x sizes T5's DynamicCache by num_layers and fails when the decoder is
        # deeper or shallower; without the cache it recomputes, with the same results.
        gen.use_cache = False
        notes.append("transformers ran with use_cache=False (its T5 cache breaks when num_decoder_layers != "
                     "num_layers)")
    return gen, notes


@dataclass
class HfModel:
    model: Any              # the transformers model, in eval mode, on ``device``
    source: ModelSource
    device: Any
    is_whisper: bool
    pad_id: int             # right-padding of text batches (the checkpoint's pad id, else 0)

    def token_batch(self, rows: list[list[int]], min_width: int = 0) -> dict:
        """Encoder token ids right-padded to one width (at least ``min_width``), with the mask."""
        import torch

        width = max(min_width, max(len(ids) for ids in rows))
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}

    def audio_batch(self, waves: list) -> dict:
        """Whisper's log-mel features of 16 kHz waves, by the checkpoint's feature extractor."""
        feats = self.source.feature_extractor(waves, sampling_rate=16000, return_tensors="pt").input_features
        return {"input_features": feats.to(self.device, self.model.dtype)}

    def generate(self, inputs: dict, generation_config, **kwargs):
        """``model.generate`` without autograd, finished on the device when it returns."""
        import torch

        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=generation_config, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def use_generation_config(self, gen) -> None:
        """Make ``gen`` the model's own too: ``generate`` fills a setting left None from
        ``model.generation_config``, which would bring back the checkpoint's forced EOS etc."""
        self.model.generation_config = gen

    def close(self) -> None:
        import torch

        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def load_hf_model(source: ModelSource, device, dtype, load_format: str = "auto") -> HfModel:
    """The checkpoint's transformers model on ``device`` in ``dtype``: the folder's weights, or
    random ones from its config for ``load_format="dummy"`` (or a known config without a
    folder). Its generation config is the source's, with the keys transformers drops restored."""
    import torch
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    transformers.logging.set_verbosity_error()   # generate's per-call advice would flood a run
    transformers.logging.disable_progress_bar()  # bench and eval draw their own
    is_whisper = source.hf_config.model_type == "whisper"
    auto = AutoModelForSpeechSeq2Seq if is_whisper else AutoModelForSeq2SeqLM
    device = torch.device(device)
    if source.path is not None and load_format != "dummy":
        model = auto.from_pretrained(source.path, dtype=dtype).to(device)
    else:
        with device:
            model = auto.from_config(source.hf_config, dtype=dtype)
    model.eval()
    model.generation_config = copy.deepcopy(source.generation_config)
    pad_id = next((t for t in (getattr(source.hf_config, "pad_token_id", None),
                               getattr(source.generation_config, "pad_token_id", None)) if t is not None), 0)
    return HfModel(model, source, device, is_whisper, pad_id)
