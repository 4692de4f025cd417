"""Agreement of the engine's output token ids with transformers' on the same inputs.

Both sides are put in one form before comparing: the generated ids after the decoder
prefix, ending with EOS when generation stopped there (the engine's own form). transformers
differs in two ways that carry no information: a batch pads finished rows (with the pad
id, which is EOS on Whisper), and Whisper's ``generate`` strips the final EOS.
"""
from __future__ import annotations

from dataclasses import dataclass


def canonical_hf_ids(ids: list[int], eos_ids: frozenset[int], max_new_tokens: int, strips_eos: bool) -> list[int]:
    """transformers' generated ids (prefix already removed) in the engine's form."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1]
    if strips_eos and len(ids) < max_new_tokens:
        # Whisper's generate removed the EOS that stopped this row.
        return ids + [min(eos_ids)]
    return ids[:max_new_tokens]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where the two differ (the shorter length when one is a
    prefix of the other); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class ParityStats:
    num_compared: int
    num_exact: int
    num_text_exact: int
    first_diffs: list[int]              # one per mismatched row

    @property
    def exact_match(self) -> float:
        return self.num_exact / self.num_compared if self.num_compared else 0.0

    @property
    def text_exact_match(self) -> float:
        return self.num_text_exact / self.num_compared if self.num_compared else 0.0

    def as_dict(self) -> dict:
        diffs = self.first_diffs
        return {
            "num_compared": self.num_compared,
            "num_exact": self.num_exact,
            "exact_match": self.exact_match,
            "text_exact_match": self.text_exact_match,
            "num_mismatched": len(diffs),
            "first_diff_mean": sum(diffs) / len(diffs) if diffs else None,
            "first_diff_min": min(diffs) if diffs else None,
        }


def parity_stats(ours: list[list[int]], theirs: list[list[int]], our_texts: list[str],
                 their_texts: list[str]) -> ParityStats:
    diffs = [d for a, b in zip(ours, theirs) if (d := first_difference(a, b)) is not None]
    text_same = sum(a.strip() == b.strip() for a, b in zip(our_texts, their_texts))
    return ParityStats(len(ours), len(ours) - len(diffs), text_same, diffs)
