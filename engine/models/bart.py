"""BART (post-norm) and mBART (pre-norm, final encoder/decoder layer_norm).

Both: token embedding times ``sqrt(d_model)`` when ``scale_embedding``, learned positions
stored with an offset of 2 (fairseq reserved the first two rows), ``layernorm_embedding``
after the sum, and ``final_logits_bias`` added to the logits. The layers here are also
Whisper's (pre-norm, with a k_proj that has no bias).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, KVCache, LayerKV
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.models.base import EncoderDecoderLM
from enc2dec.engine.models.layers import CrossAttention, DenseMLP, Embedding, LayerNorm, SelfAttention

# Checkpoint names of BART, mBART and Whisper equal ours after "model." is stripped,
# except for the fused projections, the MLP submodule and Whisper's proj_out.
BART_STYLE_RULES = [
    (r"(.*\.self_attn)\.(?P<s>[qkv])_proj\.(weight|bias)", r"\1.qkv.\3", {"q": 0, "k": 1, "v": 2}),
    (r"(.*\.encoder_attn)\.(?P<s>[kv])_proj\.(weight|bias)", r"\1.kv.\3", {"k": 0, "v": 1}),
    (r"(.*)\.(fc1|fc2)\.(weight|bias)", r"\1.mlp.\2.\3", None),
    (r"proj_out\.weight", "lm_head.weight", None),
]

POSITION_OFFSET = 2


class _Sublayers(nn.Module):
    """Residual sublayers, pre-norm (mBART, Whisper) or post-norm (BART).

    Pre-norm layers hand their last residual add to the next norm: ``forward`` takes the
    previous layer's pending ``delta`` and returns ``(delta, h)`` with ``h + delta`` the
    layer's output, so every add rides in a fused add+norm kernel (``LayerNorm.add_forward``).
    Post-norm layers fuse ``norm(h + fn(h))`` directly and return no pending delta.
    """

    def __init__(self, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm

    def sublayers(self, h: torch.Tensor, delta: torch.Tensor | None, steps) -> tuple[torch.Tensor | None, torch.Tensor]:
        # steps: [(norm, fn)] in order
        if not self.pre_norm:
            for norm, fn in steps:
                h = norm.add_forward(fn(h), h)[0]
            return None, h
        for norm, fn in steps:
            x, h = (norm(h), h) if delta is None else norm.add_forward(delta, h)
            delta = fn(x)
        return delta, h


class BartEncoderLayer(_Sublayers):
    def __init__(self, d: int, heads: int, ffn: int, act: str, pre_norm: bool, backend, k_bias: bool = True,
                 tp: TensorParallelGroup = SINGLE):
        super().__init__(pre_norm)
        scale = (d // heads) ** -0.5
        self.self_attn = SelfAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend, k_bias=k_bias,
                                       tp=tp)
        self.self_attn_layer_norm = LayerNorm(d)
        self.mlp = DenseMLP(d, ffn, act, bias=True, tp=tp)
        self.final_layer_norm = LayerNorm(d)

    def forward(self, h: torch.Tensor, meta: EncoderMetadata, delta: torch.Tensor | None = None):
        return self.sublayers(h, delta, [(self.self_attn_layer_norm, lambda x: self.self_attn.encode(x, meta)),
                                         (self.final_layer_norm, self.mlp)])


class BartDecoderLayer(_Sublayers):
    def __init__(self, d: int, heads: int, ffn: int, act: str, pre_norm: bool, backend, k_bias: bool = True,
                 tp: TensorParallelGroup = SINGLE):
        super().__init__(pre_norm)
        scale = (d // heads) ** -0.5
        self.self_attn = SelfAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend, k_bias=k_bias,
                                       tp=tp)
        self.self_attn_layer_norm = LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend,
                                           k_bias=k_bias, tp=tp)
        self.encoder_attn_layer_norm = LayerNorm(d)
        self.mlp = DenseMLP(d, ffn, act, bias=True, tp=tp)
        self.final_layer_norm = LayerNorm(d)

    def forward(self, h: torch.Tensor, meta: DecoderMetadata, self_kv: LayerKV, cross_kv: LayerKV,
                delta: torch.Tensor | None = None):
        return self.sublayers(h, delta, [
            (self.self_attn_layer_norm, lambda x: self.self_attn.decode(x, meta, self_kv)),
            (self.encoder_attn_layer_norm, lambda x: self.encoder_attn(x, meta, cross_kv)),
            (self.final_layer_norm, self.mlp)])


def run_layers(h: torch.Tensor, layer_calls, final_norm) -> torch.Tensor:
    """Apply BART-style layers (``layer_calls``: one ``(h, delta) -> (delta, h)`` per layer),
    then ``final_norm`` (None for post-norm stacks) with the last pending residual add fused in."""
    delta = None
    for call in layer_calls:
        delta, h = call(h, delta=delta)
    if final_norm is None:
        return h if delta is None else h + delta
    return final_norm(h) if delta is None else final_norm.add_forward(delta, h)[0]


class _BartStack(nn.Module):
    def __init__(self, config, is_decoder: bool, pre_norm: bool, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        d = config.d_model
        if is_decoder:
            n, heads, ffn, layer_cls = (config.decoder_layers, config.decoder_attention_heads,
                                        config.decoder_ffn_dim, BartDecoderLayer)
        else:
            n, heads, ffn, layer_cls = (config.encoder_layers, config.encoder_attention_heads,
                                        config.encoder_ffn_dim, BartEncoderLayer)
        self.embed_positions = Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.layernorm_embedding = LayerNorm(d)
        self.layers = nn.ModuleList(layer_cls(d, heads, ffn, config.activation_function, pre_norm, backend, tp=tp)
                                    for _ in range(n))
        self.layer_norm = LayerNorm(d) if pre_norm else None

    def embed(self, tok_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layernorm_embedding.add_forward(tok_embeds, self.embed_positions(positions + POSITION_OFFSET))[0]


class BartForConditionalGeneration(EncoderDecoderLM):
    pre_norm = False
    weight_rules = BART_STYLE_RULES
    optional_zero_tensors = ("final_logits_bias",)

    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        d, vocab = config.d_model, config.vocab_size
        self.embed_tokens = Embedding(vocab, d)
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.encoder = _BartStack(config, False, self.pre_norm, backend, tp)
        self.decoder = _BartStack(config, True, self.pre_norm, backend, tp)
        self._init_lm_head(vocab, d, tied=config.tie_word_embeddings)
        self.register_buffer("final_logits_bias", torch.zeros(1, vocab))     # [1, vocab]
        self.num_decoder_layers = config.decoder_layers
        self.num_decoder_heads = tp.split(config.decoder_attention_heads, "decoder attention heads")  # per rank
        self.decoder_head_dim = d // config.decoder_attention_heads
        self.max_decoder_positions = config.max_position_embeddings
        self.max_encoder_positions = config.max_position_embeddings

    def encode(self, input_ids: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        h = self.encoder.embed(self.embed_tokens(input_ids) * self.embed_scale, meta.positions)   # [T, d]
        return run_layers(h, [functools.partial(layer, meta=meta) for layer in self.encoder.layers],
                          self.encoder.layer_norm)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecoderMetadata,
               kv: KVCache) -> torch.Tensor:
        h = self.decoder.embed(self.embed_tokens(input_ids) * self.embed_scale, positions)        # [N, d]
        calls = [functools.partial(layer, meta=meta, self_kv=skv, cross_kv=ckv)
                 for layer, skv, ckv in zip(self.decoder.layers, kv.self_kv, kv.cross_kv)]
        return run_layers(h, calls, self.decoder.layer_norm)


class MBartForConditionalGeneration(BartForConditionalGeneration):
    pre_norm = True
