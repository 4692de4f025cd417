"""The argmax of a float32 LM head on the CPU, reading half its bytes.

A greedy decode step at one row on the CPU reads the whole LM head (flan-t5-small: 32,128 x 512
floats, 66 MB, ~2.6 ms of an ~11.7 ms step on 2 cores) to keep one id. ``GreedyHead`` finds that
id through a bfloat16 copy of the head (prepacked for oneDNN where the CPU has its bfloat16
linear, else multiplied by ATen's bfloat16 product), and then proves it:

1. ``approx = bf16(x) @ bf16(W).T``: every logit within ``err`` of its float32 value, where
   ``err <= ERR_SCALE * |x| * max_j |w_j|`` (x and w rounded to bfloat16: 2^-8 of
   ``sum_i |x_i w_ij|``, the bfloat16 output 2^-9 more, float32 accumulation well below; by
   Cauchy-Schwarz that sum is at most ``|x| |w_j|``).
2. Let ``a*`` be the row's largest approximation. An id whose approximation is below
   ``a* - 2 err`` has a float32 logit below ``a* - err``, which the id of ``a*`` reaches: it
   cannot be the argmax. The ids at or above that threshold (a handful a row) are recomputed in
   float32 and the best of them taken (the lowest id on a tie, as ``torch.argmax``).
3. A row with more than ``MAX_CANDIDATES`` such ids (a near-flat distribution) or none (NaNs)
   takes the float32 head instead.

So the chosen ids are those of the float32 head up to float32 rounding, which is what the float32
head promises too (its GEMV's summation order is not transformers' either). Masks (suppress lists,
begin-suppress, min_tokens, bad words) remove their ids from the approximation first, so the id
is the argmax over the ids left. Only steps whose rows all want that argmax take it
(``masked_greedy``): log-probs, penalties, logit bias, processors and draws read whole rows.
"""
from __future__ import annotations

import torch

# The bound's factor: 2 * 2^-9 for the rounded inputs, 2^-9 for the rounded output, plus room for
# float32 accumulation (D * 2^-24 of the same sum: 3e-5 at D=512, 8e-5 at 1280).
ERR_SCALE = 2.0 ** -8 + 2.0 ** -9 + 5e-4
# More candidates than this a row (a near-flat distribution) and the step takes the float32 head.
MAX_CANDIDATES = 64


def onednn_bf16() -> bool:
    """oneDNN's prepacked linear with bfloat16 weights on this CPU: it needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT; on an AVX2-only CPU (AMD Zen 2/3, Intel before Skylake-SP) the weight's
    reorder raises."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")):
        return False
    supported = getattr(mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is None or bool(supported())


def greedy_head_available() -> bool:
    """A bfloat16 product of the head faster than the float32 one on this CPU: oneDNN's (above),
    else ATen's own bfloat16 matmul on an x86 CPU with AVX2 (float32 accumulation, the output
    rounded to bfloat16: the bound above). On a 2-core AMD EPYC without AVX-512 flan-t5-small's
    head took 3.5 ms that way against 10.7 ms in float32 (docs/benchmarks.md, session 39)."""
    return onednn_bf16() or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class GreedyHead:
    """``head(hidden [S, d_model] float32) -> [S] int64``: each row's argmax over the model's
    float32 logits (``model.compute_logits``), computed as above. Holds a bfloat16 copy of the
    head (half the float32 head's memory)."""

    def __init__(self, model):
        self.model = model
        self.packed = None             # made at the first call: a model whose rows never come here
        self.fallback_rows = 0         # (Whisper's always mask tokens) never holds the copy

    def _prepare(self) -> None:
        model = self.model
        weight = (model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight).detach()
        self.weight = weight                                          # [V, D] float32, shared with the model
        copy = weight.to(torch.bfloat16)
        self.onednn = onednn_bf16()
        if self.onednn:
            try:
                copy = torch.ops.mkldnn._reorder_linear_weight(copy, None)
            except RuntimeError:        # refused on this CPU after all: ATen's product instead
                self.onednn = False
        self.packed = copy if self.onednn else copy.t()               # [D, V] for ATen's x @ W^T
        self.max_row_norm = float(weight.norm(dim=1).max())
        bias = getattr(model, "final_logits_bias", None)               # [1, V] (BART) or absent
        self.bias = None if bias is None else bias.detach().reshape(-1).float()
        self.scale = model.logits_scale

    def __call__(self, hidden: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mask``: (rows, ids) that this step's masks remove (suppress lists, begin-suppress,
        min_tokens): each row's argmax is over the ids left, as over the masked float32 logits."""
        if self.packed is None:
            self._prepare()
        x = hidden * self.scale if self.scale != 1.0 else hidden                        # [S, D]
        num_rows, vocab = x.shape[0], self.weight.shape[0]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)                         # [S, 1]
        if self.onednn:
            approx = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "")
        else:
            approx = torch.mm(x.to(torch.bfloat16), self.packed)                        # [S, V] bfloat16
        if self.bias is not None:
            approx = approx.float() + self.bias                                          # [S, V]
        if mask is not None:
            approx.index_put_(mask, torch.tensor(float("-inf"), dtype=approx.dtype))
        # Every id whose float32 logit may reach the likeliest approximation's: within 2 err of it.
        threshold = approx.amax(dim=-1, keepdim=True).float().sub_(norm, alpha=2 * ERR_SCALE * self.max_row_norm)
        rows, ids = (approx >= threshold).nonzero(as_tuple=True)                        # [M] each, rows ascending
        if not 0 < ids.numel() <= MAX_CANDIDATES * num_rows:     # a near-flat row, or NaNs (no candidate)
            return self._fallback(hidden, mask, torch.arange(num_rows), torch.empty(num_rows, dtype=torch.long))
        if num_rows == 1:
            exact = torch.mv(self.weight.index_select(0, ids), x[0])                     # [M] float32
            if self.bias is not None:
                exact += self.bias.index_select(0, ids)
            return ids[exact.argmax()].reshape(1)     # ids ascending: the first maximum is the lowest id
        exact = (self.weight.index_select(0, ids) * x.index_select(0, rows)).sum(-1)
        if self.bias is not None:
            exact += self.bias.index_select(0, ids)
        best = torch.full((num_rows,), float("-inf")).scatter_reduce(0, rows, exact, "amax")
        # The lowest id among those reaching their row's best (torch.argmax's tie rule).
        tokens = torch.full((num_rows,), vocab).scatter_reduce(0, rows, torch.where(exact == best[rows], ids, vocab),
                                                               "amin")
        missing = (tokens == vocab).nonzero().squeeze(1)
        return self._fallback(hidden, mask, missing, tokens) if missing.numel() else tokens

    def _fallback(self, hidden: torch.Tensor, mask, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self.fallback_rows += rows.numel()
        logits = self.model.compute_logits(hidden)
        if mask is not None:
            logits.index_put_(mask, torch.tensor(float("-inf")))
        tokens[rows] = logits[rows].max(dim=-1).indices
        return tokens
