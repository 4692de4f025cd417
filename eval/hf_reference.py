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

import time

from .parity import canonical_hf_ids


class HfReference:
    def __init__(self, model_path: str, device, dtype, hf_config, generation_config, tokenizer,
                 feature_extractor, max_new_tokens: int, whisper_kwargs: dict | None, eos_ids: frozenset[int],
                 num_beams: int = 1):
        from enc2dec.engine.inputs.hf_reference import engine_generation_config, load_hf_model
        from enc2dec.engine.inputs.model_source import ModelSource

        source = ModelSource(model_path, hf_config, generation_config, tokenizer, feature_extractor)
        self.hf = load_hf_model(source, device, dtype)
        self.is_whisper, self.device, self.tokenizer = self.hf.is_whisper, self.hf.device, tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.whisper_kwargs = whisper_kwargs or {}
        gen, self.notes = engine_generation_config(generation_config, hf_config, num_beams)
        gen.max_new_tokens, gen.pad_token_id = max_new_tokens, self.hf.pad_id
        self.hf.use_generation_config(gen)
        self.generation_config = gen

    # ---- one batch -----------------------------------------------------------------------------
    def _inputs(self, items: list) -> dict:
        if self.is_whisper:
            return {**self.hf.audio_batch(list(items)), **self.whisper_kwargs}
        return self.hf.token_batch(items)

    def _generate(self, items: list) -> list[list[int]]:
        rows = self.hf.generate(self._inputs(items), self.generation_config).tolist()
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
        self.hf.close()
