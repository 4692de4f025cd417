"""BART (post-norm) and mBART (pre-norm, final encoder/decoder layer_norm).

Both: token embedding times ``sqrt(d_model)`` when ``scale_embedding``, learned positions
stored with an offset of 2 (fairseq reserved the first two rows), ``layernorm_embedding``
after the sum, and ``final_logits_bias`` added to the logits. The layers here are also
Whisper's (pre-norm, with a k_proj that has no bias).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from enc2dec.engine.attention import DecoderMetadata, EncoderMetadata, KVCache, LayerKV
from enc2dec.engine.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.models.base import EncoderDecoderLM
from enc2dec.engine.models.layers import CrossAttention, DenseMLP, SelfAttention, clamp_fp16

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
    def __init__(self, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm

    def residual(self, h: torch.Tensor, norm: nn.LayerNorm, fn) -> torch.Tensor:
        out = h + fn(norm(h)) if self.pre_norm else norm(h + fn(h))
        return clamp_fp16(out)


class BartEncoderLayer(_Sublayers):
    def __init__(self, d: int, heads: int, ffn: int, act: str, pre_norm: bool, backend, k_bias: bool = True,
                 tp: TensorParallelGroup = SINGLE):
        super().__init__(pre_norm)
        scale = (d // heads) ** -0.5
        self.self_attn = SelfAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend, k_bias=k_bias,
                                       tp=tp)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.mlp = DenseMLP(d, ffn, act, bias=True, tp=tp)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        h = self.residual(h, self.self_attn_layer_norm, lambda x: self.self_attn.encode(x, meta))
        return self.residual(h, self.final_layer_norm, self.mlp)


class BartDecoderLayer(_Sublayers):
    def __init__(self, d: int, heads: int, ffn: int, act: str, pre_norm: bool, backend, k_bias: bool = True,
                 tp: TensorParallelGroup = SINGLE):
        super().__init__(pre_norm)
        scale = (d // heads) ** -0.5
        self.self_attn = SelfAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend, k_bias=k_bias,
                                       tp=tp)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads, d // heads, bias=True, scale=scale, backend=backend,
                                           k_bias=k_bias, tp=tp)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.mlp = DenseMLP(d, ffn, act, bias=True, tp=tp)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, meta: DecoderMetadata, self_kv: LayerKV, cross_kv: LayerKV) -> torch.Tensor:
        h = self.residual(h, self.self_attn_layer_norm, lambda x: self.self_attn.decode(x, meta, self_kv))
        h = self.residual(h, self.encoder_attn_layer_norm, lambda x: self.encoder_attn(x, meta, cross_kv))
        return self.residual(h, self.final_layer_norm, self.mlp)


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
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.layernorm_embedding = nn.LayerNorm(d)
        self.layers = nn.ModuleList(layer_cls(d, heads, ffn, config.activation_function, pre_norm, backend, tp=tp)
                                    for _ in range(n))
        self.layer_norm = nn.LayerNorm(d) if pre_norm else None

    def embed(self, tok_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layernorm_embedding(tok_embeds + self.embed_positions(positions + POSITION_OFFSET))

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(h) if self.layer_norm is not None else h


class BartForConditionalGeneration(EncoderDecoderLM):
    pre_norm = False
    weight_rules = BART_STYLE_RULES
    optional_zero_tensors = ("final_logits_bias",)

    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        d, vocab = config.d_model, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, d)
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
        for layer in self.encoder.layers:
            h = layer(h, meta)
        return self.encoder.finish(h)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecoderMetadata,
               kv: KVCache) -> torch.Tensor:
        h = self.decoder.embed(self.embed_tokens(input_ids) * self.embed_scale, positions)        # [N, d]
        for layer, self_kv, cross_kv in zip(self.decoder.layers, kv.self_kv, kv.cross_kv):
            h = layer(h, meta, self_kv, cross_kv)
        return self.decoder.finish(h)


class MBartForConditionalGeneration(BartForConditionalGeneration):
    pre_norm = True
