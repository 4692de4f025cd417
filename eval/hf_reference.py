"""The reference: transformers ``generate`` on the same inputs with the same decoding.

Same checkpoint folder, dtype and device as the engine; the encoder inputs are the token ids
the engine itself encoded (text) or the same 16 kHz waves (Whisper). Decoding is greedy (or
beam search with the engine's ``num_beams``, length_penalty 1.0, early_stopping False, as the
engine's defaults) with ``max_new_tokens`` equal to the engine's ``max_tokens``, and everything
the engine does not do is switched off: sampling, no-repeat n-grams, repetition penalties,
minimum lengths, a forced EOS at the limit. The checkpoint's own settings that this overrides
are listed in ``notes``, because they change what "the model's answer" means.

Rows run in batches (text sorted by length, right-padded with an attention mask). Padding
and batch shape can move float results by an ulp, so a row whose batched result differs
from the engine's is run again alone (``generate_alone``) and that result is the reference.
"""
from __future__ import annotations

import copy
import time

from .parity import canonical_hf_ids

# generation-config keys and the values that make transformers decode as the engine does
_GREEDY = {
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


def _greedy_config(gen, is_whisper: bool):
    gen = copy.deepcopy(gen)
    notes = []
    for key, neutral in _GREEDY.items():
        old = getattr(gen, key, None)
        if key in _NOTEWORTHY and old not in (None, neutral, 0, 1.0, False):
            notes.append(f"{key}={old}")
        setattr(gen, key, neutral)
    if not is_whisper:      # the engine applies token suppression to Whisper only
        for key in ("suppress_tokens", "begin_suppress_tokens"):
            if getattr(gen, key, None):
                notes.append(f"{key}={getattr(gen, key)}")
            setattr(gen, key, None)
    return gen, notes


class HfReference:
    def __init__(self, model_path: str, device, dtype, hf_config, generation_config, tokenizer,
                 feature_extractor, max_new_tokens: int, whisper_kwargs: dict | None, eos_ids: frozenset[int],
                 num_beams: int = 1):
        import torch
        import transformers
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

        transformers.logging.set_verbosity_error()   # per-call advice on max_length etc. would flood the run
        transformers.logging.disable_progress_bar()  # eval draws its own
        self.is_whisper = hf_config.model_type == "whisper"
        self.device, self.tokenizer, self.feature_extractor = device, tokenizer, feature_extractor
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.whisper_kwargs = whisper_kwargs or {}
        auto = AutoModelForSpeechSeq2Seq if self.is_whisper else AutoModelForSeq2SeqLM
        self.model = auto.from_pretrained(model_path, dtype=dtype).to(device).eval()
        gen, overridden = _greedy_config(generation_config, self.is_whisper)
        gen.num_beams = num_beams      # the engine's width; length_penalty / early_stopping stay at its defaults
        how = "greedily" if num_beams == 1 else f"with num_beams={num_beams}"
        self.notes = [(f"the checkpoint's generation config sets {', '.join(overridden)}; both sides decode "
                       f"{how} without them")] if overridden else []
        if hf_config.model_type == "t5" and (hf_config.num_decoder_layers or hf_config.num_layers) != \
                hf_config.num_layers:
            # transformers 5.x sizes T5's DynamicCache by num_layers and fails when the decoder is
            # deeper or shallower; without the cache it recomputes, with the same results.
            gen.use_cache = False
            self.notes.append("transformers ran with use_cache=False (its T5 cache breaks when "
                              "num_decoder_layers != num_layers)")
        self.pad_id = next((t for t in (hf_config.pad_token_id, getattr(generation_config, "pad_token_id", None))
                            if t is not None), 0)
        gen.max_new_tokens, gen.pad_token_id = max_new_tokens, self.pad_id
        # generate() fills a setting left None from model.generation_config: it must be ours too,
        # or the checkpoint's forced_eos_token_id etc. come back.
        self.model.generation_config = self.generation_config = gen
        self._torch = torch

    # ---- one batch -----------------------------------------------------------------------------
    def _inputs(self, items: list) -> dict:
        torch = self._torch
        if self.is_whisper:
            feats = self.feature_extractor([wave for wave in items], sampling_rate=16000,
                                           return_tensors="pt").input_features
            return {"input_features": feats.to(self.device, self.model.dtype), **self.whisper_kwargs}
        width = max(len(ids) for ids in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, ids in enumerate(items):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}

    def _generate(self, items: list) -> list[list[int]]:
        torch = self._torch
        with torch.inference_mode():
            out = self.model.generate(**self._inputs(items), generation_config=self.generation_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rows = out.tolist()
        # Text models return the decoder start token first; Whisper (transformers 5) returns only
        # what follows the prefix and strips the final EOS.
        rows = [r if self.is_whisper else r[1:] for r in rows]
        return [canonical_hf_ids(r, self.eos_ids, self.max_new_tokens, strips_eos=self.is_whisper) for r in rows]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---- the run --------------------------------------------------------------------------------
    def run(self, items: dict[int, object], batch_size: int, progress) -> tuple[dict[int, list[int]], float]:
        """items: row -> encoder token ids (text) or a 16 kHz wave (Whisper). Returns row -> ids and
        the wall-clock seconds of the batched pass (input preparation included)."""
        rows = list(items)
        if not self.is_whisper:     # similar lengths together: less padding
            rows.sort(key=lambda r: len(items[r]))
        results: dict[int, list[int]] = {}
        progress.start("transformers", len(rows))
        start = time.perf_counter()
        for i in range(0, len(rows), batch_size):
            batch = rows[i:i + batch_size]
            for row, ids in zip(batch, self._generate([items[r] for r in batch])):
                results[row] = ids
            progress.advance(len(batch))
        wall_s = time.perf_counter() - start
        progress.stop()
        return results, wall_s

    def generate_alone(self, item) -> list[int]:
        return self._generate([item])[0]

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()
