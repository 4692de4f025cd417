"""Token selection for one decoder step: logit filters, greedy / random sampling, logprobs.

Per-request state (seeded generators, suppress lists) lives in ``SeqSamplingState``; the
sampler builds one batched set of tensors per step. Greedy rows never touch an RNG, and
a seeded request draws from its own generator, so its tokens do not depend on which
other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


@dataclass
class SeqSamplingState:
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    suppress_token_ids: tuple[int, ...] = ()          # always masked (Whisper generation config)
    begin_suppress_token_ids: tuple[int, ...] = ()    # masked at the first generated position
    generator: torch.Generator | None = None
    min_tokens_mask_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        self.min_tokens_mask_ids = tuple(sorted(set(self.eos_token_ids) | set(self.stop_token_ids)))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None               # of the chosen token, per row
    top_logprobs: list[dict[int, float]] | None = None


def _mask_indices(states: list[SeqSamplingState], num_output_tokens: list[int]):
    rows, cols = [], []
    for r, (st, n_out) in enumerate(zip(states, num_output_tokens)):
        ids = list(st.suppress_token_ids)
        if n_out == 0:
            ids += st.begin_suppress_token_ids
        if n_out < st.params.min_tokens and not st.params.ignore_eos:
            ids += st.min_tokens_mask_ids
        rows += [r] * len(ids)
        cols += ids
    return rows, cols


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [R, V]; top_k: [R] int (0 = off); top_p: [R] float (1.0 = off)
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs        # mass strictly before each token
    drop |= cum_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, states: list[SeqSamplingState],
                 num_output_tokens: list[int]) -> SamplerOutput:
        # logits: [S, V] float32; num_output_tokens: tokens each row has produced so far
        rows, cols = _mask_indices(states, num_output_tokens)
        if rows:
            logits = logits.index_put((torch.tensor(rows, device=logits.device),
                                       torch.tensor(cols, device=logits.device)),
                                      torch.tensor(float("-inf"), device=logits.device))
        greedy = [st.params.is_greedy for st in states]
        chosen = logits.argmax(dim=-1)                                      # [S]
        if not all(greedy):
            idx = [i for i, g in enumerate(greedy) if not g]
            chosen[idx] = self._sample(logits[idx], [states[i] for i in idx])
        want = [st.params.logprobs for st in states]
        if all(w is None for w in want):
            return SamplerOutput(chosen.tolist())
        logp = logits.log_softmax(dim=-1)                                   # [S, V]
        chosen_lp = logp.gather(1, chosen[:, None])[:, 0]
        top = max(w or 0 for w in want)
        tops: list[dict[int, float]] = []
        if top > 0:
            vals, ids = logp.topk(top, dim=-1)
            for r, w in enumerate(want):
                tops.append({int(i): float(v) for i, v in zip(ids[r, :w or 0].tolist(), vals[r, :w or 0].tolist())})
        else:
            tops = [{} for _ in states]
        token_ids = chosen.tolist()
        lps = chosen_lp.tolist()
        for r, w in enumerate(want):
            if w is not None:
                tops[r][token_ids[r]] = lps[r]
        return SamplerOutput(token_ids, lps, [t if w is not None else None for t, w in zip(tops, want)])

    @staticmethod
    def _sample(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        # logits: [R, V]
        dev = logits.device
        temp = torch.tensor([st.params.temperature if st.params.temperature is not None else 1.0
                             for st in states], device=dev, dtype=logits.dtype)
        logits = logits / temp[:, None]
        top_k = torch.tensor([st.params.top_k or 0 for st in states], device=dev)
        top_p = torch.tensor([st.params.top_p if st.params.top_p is not None else 1.0 for st in states],
                             device=dev, dtype=logits.dtype)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            logits = _filter_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one RNG stream per seeded row.
        noise = torch.empty_like(probs)
        unseeded = [r for r, st in enumerate(states) if st.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=dev,
                                          dtype=probs.dtype).exponential_()
        for r, st in enumerate(states):
            if st.generator is not None:
                noise[r].exponential_(generator=st.generator)
        return (probs / noise).argmax(dim=-1)
