"""The accuracy figures: BLEU and chrF (sacrebleu), ROUGE (rouge-score), WER and CER (jiwer).

Each library is imported where it is used, so a missing one is a clear error that names
the package, never an ImportError traceback. WER and CER are computed on text passed
through Whisper's normalizer (English: ``EnglishTextNormalizer``, with the checkpoint's
spelling map when its folder has ``normalizer.json``; other languages: ``BasicTextNormalizer``).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import EvalInputError

_PACKAGES = {"sacrebleu": "sacrebleu", "rouge_score": "rouge-score", "jiwer": "jiwer"}


def _require(module: str):
    import importlib

    package = _PACKAGES[module.split(".")[0]]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise EvalInputError(f"this task's metrics need {package}: pip install {package} "
                             "(or pip install 'enc2dec[eval]')") from None


def check_available(metrics: tuple[str, ...]) -> None:
    """Fail before any model runs when a metric's package is missing."""
    needed = {"bleu": "sacrebleu", "chrf": "sacrebleu", "wer": "jiwer", "cer": "jiwer"}
    for m in metrics:
        _require(needed.get(m, "rouge_score.rouge_scorer"))


@dataclass(frozen=True)
class Normalizer:
    name: str                       # what ran, in words, for the report
    fn: Callable[[str], str]

    def __call__(self, text: str) -> str:
        return self.fn(text)


def whisper_normalizer(model_path: str | None, tokenizer, language: str | None) -> Normalizer:
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    if language not in (None, "en", "english"):
        return Normalizer(f"Whisper BasicTextNormalizer (language {language})", BasicTextNormalizer())
    spelling = getattr(tokenizer, "english_spelling_normalizer", None)
    where = "the tokenizer"
    if spelling is None and model_path and os.path.isfile(os.path.join(model_path, "normalizer.json")):
        import json

        with open(os.path.join(model_path, "normalizer.json"), encoding="utf-8") as f:
            spelling, where = json.load(f), "normalizer.json"
    if spelling:
        return Normalizer(f"Whisper EnglishTextNormalizer with the checkpoint's spelling map ({where}, "
                          f"{len(spelling)} entries)", EnglishTextNormalizer(spelling))
    return Normalizer("Whisper EnglishTextNormalizer without the British-to-American spelling map (the "
                      "checkpoint has no normalizer.json)", EnglishTextNormalizer({}))


def bleu_chrf(hyps: list[str], refs: list[str]) -> tuple[dict, dict]:
    sacrebleu = _require("sacrebleu")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score}, {"bleu": str(bleu.get_signature()),
                                                 "chrf": str(chrf.get_signature())}


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentences(text: str) -> str:
    # ROUGE-Lsum scores sentence by sentence: one sentence a line (kept if the text has lines).
    return text if "\n" in text else "\n".join(s for s in _SENTENCE_END.split(text.strip()) if s)


def rouge(hyps: list[str], refs: list[str]) -> dict:
    rouge_scorer = _require("rouge_score.rouge_scorer")
    keys = ("rouge1", "rouge2", "rougeL", "rougeLsum")
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    totals = dict.fromkeys(keys, 0.0)
    for hyp, ref in zip(hyps, refs):
        scores = scorer.score(_sentences(ref), _sentences(hyp))
        for k in keys:
            totals[k] += scores[k].fmeasure
    return {k: 100.0 * v / max(len(hyps), 1) for k, v in totals.items()}


def wer_cer(hyps: list[str], refs: list[str]) -> dict:
    """Inputs already normalized; references must be non-empty (the session drops rows whose
    reference normalizes to nothing)."""
    jiwer = _require("jiwer")
    return {"wer": jiwer.wer(refs, hyps), "cer": jiwer.cer(refs, hyps)}


def score(metrics: tuple[str, ...], hyps: list[str], refs: list[str],
          normalizer: Normalizer | None = None) -> tuple[dict, dict]:
    """(figures, notes such as sacrebleu signatures) for the task's metrics."""
    hyps = [h.strip() for h in hyps]
    if "wer" in metrics:
        assert normalizer is not None
        return wer_cer([normalizer(h) for h in hyps], [normalizer(r) for r in refs]), {}
    if "bleu" in metrics:
        return bleu_chrf(hyps, refs)
    return rouge(hyps, refs), {"rouge": "rouge-score F-measure x 100, Porter stemmer, sentences split "
                                        "at . ! ? for ROUGE-Lsum"}
