"""T5 family: T5 v1.0 (relu MLP, tied head scaled by d_model**-0.5), T5 v1.1 / Flan-T5 /
ByT5 (gated-gelu MLP, untied head), with any ``num_decoder_layers``.

T5 has no absolute positions: each stack owns one relative-position bias embedding
(the checkpoint keeps it in block 0) that the model turns into a per-head table once per
call and hands to the backend, which indexes it by key/query distance. T5 attention is
not scaled (scale = 1.0): the 1/sqrt(d) is folded into the initialisation of q.
With tensor parallelism the bias embedding is split by heads like the attention it feeds.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, KVCache, LayerKV
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.models.base import EncoderDecoderLM
from enc2dec.engine.models.layers import CrossAttention, DenseMLP, Embedding, GatedMLP, RMSNorm, SelfAttention

_QKV = {"q": 0, "k": 1, "v": 2}
_KV = {"k": 0, "v": 1}
_GATE_UP = {"0": 0, "1": 1}
# HF block i, sub-layer j -> our layer i (groups 1 and 2 of the block pattern).
_BLOCK = r"(encoder|decoder)\.block\.(\d+)\.layer\."
_DEC_BLOCK = r"(decoder)\.block\.(\d+)\.layer\."
_LAYER = r"\1.layers.\2."


def relative_position_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of ``rel = key_pos - query_pos``: one bucket per distance below
    ``num_buckets // 2``, log-spaced buckets up to ``max_distance``, then saturated.
    Bidirectional tables give keys after the query their own half of the buckets."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)                       # causal: only keys at or before the query
    max_exact = num_buckets // 2
    log_ratio = torch.log(dist.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(dist < max_exact, dist, large)


class RelativeBias(Embedding):
    """[num_buckets, heads]; a rank keeps the columns of its own heads."""

    tp_dims = {"weight": 1}


class T5Layer(nn.Module):
    def __init__(self, config, is_decoder: bool, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        d, heads, d_kv, eps = config.d_model, config.num_heads, config.d_kv, config.layer_norm_epsilon
        self.self_attn_norm = RMSNorm(d, eps)
        self.self_attn = SelfAttention(d, heads, d_kv, bias=False, scale=1.0, backend=backend, tp=tp)
        if is_decoder:
            self.encoder_attn_norm = RMSNorm(d, eps)
            self.encoder_attn = CrossAttention(d, heads, d_kv, bias=False, scale=1.0, backend=backend, tp=tp)
        self.mlp_norm = RMSNorm(d, eps)
        if config.is_gated_act:
            self.mlp = GatedMLP(d, config.d_ff, config.dense_act_fn, option="feed_forward_proj", tp=tp)
        else:
            self.mlp = DenseMLP(d, config.d_ff, config.dense_act_fn, bias=False, option="feed_forward_proj", tp=tp)

    # Both directions return ``(delta, h)`` with ``h + delta`` the layer's output: the last
    # residual add rides in the next layer's first norm (or the final norm) kernel.
    def encode(self, h: torch.Tensor, delta: torch.Tensor | None, meta: EncoderMetadata, bias: torch.Tensor):
        x, h = (self.self_attn_norm(h), h) if delta is None else self.self_attn_norm.add_forward(delta, h)
        x, h = self.mlp_norm.add_forward(self.self_attn.encode(x, meta, bias), h)
        return self.mlp(x), h

    def decode(self, h: torch.Tensor, delta: torch.Tensor | None, meta: DecoderMetadata, self_kv: LayerKV,
               cross_kv: LayerKV, bias_table: torch.Tensor):
        x, h = (self.self_attn_norm(h), h) if delta is None else self.self_attn_norm.add_forward(delta, h)
        x, h = self.encoder_attn_norm.add_forward(self.self_attn.decode(x, meta, self_kv, bias_table), h)
        x, h = self.mlp_norm.add_forward(self.encoder_attn(x, meta, cross_kv), h)
        return self.mlp(x), h


class T5Stack(nn.Module):
    def __init__(self, config, num_layers: int, is_decoder: bool, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.is_decoder = is_decoder
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.rel_bias = RelativeBias(self.num_buckets, tp.split(config.num_heads, "attention heads"))
        self.layers = nn.ModuleList(T5Layer(config, is_decoder, backend, tp) for _ in range(num_layers))
        self.final_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self._tables: list[tuple[tuple, int, torch.Tensor]] = []   # (weight key, length, table)

    def bias_table(self, length: int) -> torch.Tensor:
        """A table covering at least ``length`` positions, computed once and reused.

        Encoder: [H, 2L-1], column ``k - q + L - 1``; decoder: [H, L], column ``q - k``, where
        the backends read L from the table's width, so a wider table gives the same biases.
        Reuse keeps the bucketing out of every decoder step (and out of CUDA graphs); tables
        are never freed once made, because a captured graph may still read an older one.
        """
        weight = self.rel_bias.weight
        key = (weight._version, weight.device, weight.dtype)
        if not self._tables or self._tables[-1][0] != key or self._tables[-1][1] < length:
            capacity = max(64, 1 << (length - 1).bit_length())
            self._tables.append((key, capacity, self._compute_table(capacity)))
        return self._tables[-1][2]

    def _compute_table(self, length: int) -> torch.Tensor:
        device = self.rel_bias.weight.device
        if self.is_decoder:
            rel = -torch.arange(length, device=device)                         # k - q = -(q - k)
        else:
            rel = torch.arange(-(length - 1), length, device=device)
        buckets = relative_position_bucket(rel, not self.is_decoder, self.num_buckets, self.max_distance)
        return self.rel_bias(buckets).t().contiguous()                          # [H, len(rel)]


class T5ForConditionalGeneration(EncoderDecoderLM):
    weight_rules = [  # first match wins
        (_BLOCK + r"0\.SelfAttention\.(?P<s>[qkv])\.weight", _LAYER + "self_attn.qkv.weight", _QKV),
        (_BLOCK + r"0\.SelfAttention\.o\.weight", _LAYER + "self_attn.out_proj.weight", None),
        (r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
         r"\1.rel_bias.weight", None),
        (_BLOCK + r"0\.layer_norm\.weight", _LAYER + "self_attn_norm.weight", None),
        (_DEC_BLOCK + r"1\.EncDecAttention\.q\.weight", _LAYER + "encoder_attn.q_proj.weight", None),
        (_DEC_BLOCK + r"1\.EncDecAttention\.(?P<s>[kv])\.weight", _LAYER + "encoder_attn.kv.weight", _KV),
        (_DEC_BLOCK + r"1\.EncDecAttention\.o\.weight", _LAYER + "encoder_attn.out_proj.weight", None),
        # Some v1.0 checkpoints carry a cross-attention bias that transformers never uses either.
        (_DEC_BLOCK + r"1\.EncDecAttention\.relative_attention_bias\.weight", None, None),
        (_DEC_BLOCK + r"1\.layer_norm\.weight", _LAYER + "encoder_attn_norm.weight", None),
        # The MLP sub-layer is layer.1 in the encoder and layer.2 in the decoder.
        (_BLOCK + r"[12]\.DenseReluDense\.wi\.weight", _LAYER + "mlp.fc1.weight", None),
        (_BLOCK + r"[12]\.DenseReluDense\.wi_(?P<s>[01])\.weight", _LAYER + "mlp.gate_up.weight", _GATE_UP),
        (_BLOCK + r"[12]\.DenseReluDense\.wo\.weight", _LAYER + "mlp.fc2.weight", None),
        (_BLOCK + r"[12]\.layer_norm\.weight", _LAYER + "mlp_norm.weight", None),
        (r"(encoder|decoder)\.final_layer_norm\.weight", r"\1.final_norm.weight", None),
    ]

    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        d = config.d_model
        self.embed_tokens = Embedding(config.vocab_size, d)
        self.encoder = T5Stack(config, config.num_layers, False, backend, tp)
        self.decoder = T5Stack(config, config.num_decoder_layers, True, backend, tp)
        # transformers >= 5 forces tie_word_embeddings=True on T5 and keeps the checkpoint's
        # own flag as scale_decoder_outputs; older versions have only tie_word_embeddings.
        tied = bool(getattr(config, "scale_decoder_outputs", config.tie_word_embeddings))
        self._init_lm_head(config.vocab_size, d, tied=tied, logits_scale=d ** -0.5 if tied else 1.0)
        self.num_decoder_layers = config.num_decoder_layers
        self.num_decoder_heads = tp.split(config.num_heads, "attention heads")  # per rank
        self.decoder_head_dim = config.d_kv
        self.max_decoder_positions = None
        self.max_encoder_positions = None

    def encode(self, input_ids: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)                                        # [T, d]
        bias = self.encoder.bias_table(meta.max_seqlen)                         # [H, 2L-1]
        delta = None
        for layer in self.encoder.layers:
            delta, h = layer.encode(h, delta, meta, bias)
        return self.encoder.final_norm.add_forward(delta, h)[0]

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecoderMetadata,
               kv: KVCache) -> torch.Tensor:
        # positions are implied by meta (relative bias); the argument keeps one signature for all models.
        h = self.embed_tokens(input_ids)                                        # [N, d]
        bias = self.decoder.bias_table(max(meta.seq_lens_host))                 # [H, L]
        delta = None
        for layer, self_kv, cross_kv in zip(self.decoder.layers, kv.self_kv, kv.cross_kv):
            delta, h = layer.decode(h, delta, meta, self_kv, cross_kv, bias)
        return self.decoder.final_norm.add_forward(delta, h)[0]
