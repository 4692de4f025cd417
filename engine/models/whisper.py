"""Whisper: a log-mel encoder (two gelu convolutions, the second with stride 2, so 3000
frames become 1500 positions, plus the checkpoint's sinusoidal position table) and a text
decoder with learned positions. Layers are pre-norm BART layers whose k_proj has no
bias; the LM head is tied to the decoder embedding. Under tensor parallelism the
convolutions are replicated (a few percent of the encoder's FLOPs, once per request).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, KVCache
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.models.bart import BART_STYLE_RULES, BartDecoderLayer, BartEncoderLayer, run_layers
from enc2dec.engine.models.base import EncoderDecoderLM
from enc2dec.engine.models.layers import Embedding, LayerNorm


class WhisperEncoder(nn.Module):
    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(
            BartEncoderLayer(d, config.encoder_attention_heads, config.encoder_ffn_dim, config.activation_function,
                             pre_norm=True, backend=backend, k_bias=False, tp=tp)
            for _ in range(config.encoder_layers))
        self.layer_norm = LayerNorm(d)


class WhisperDecoder(nn.Module):
    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        d = config.d_model
        self.embed_positions = Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(
            BartDecoderLayer(d, config.decoder_attention_heads, config.decoder_ffn_dim, config.activation_function,
                             pre_norm=True, backend=backend, k_bias=False, tp=tp)
            for _ in range(config.decoder_layers))
        self.layer_norm = LayerNorm(d)


class WhisperForConditionalGeneration(EncoderDecoderLM):
    weight_rules = BART_STYLE_RULES

    def __init__(self, config, backend, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        d = config.d_model
        self.embed_tokens = Embedding(config.vocab_size, d)
        self.encoder = WhisperEncoder(config, backend, tp)
        self.decoder = WhisperDecoder(config, backend, tp)
        self._init_lm_head(config.vocab_size, d, tied=config.tie_word_embeddings)
        self.num_decoder_layers = config.decoder_layers
        self.num_decoder_heads = tp.split(config.decoder_attention_heads, "decoder attention heads")  # per rank
        self.decoder_head_dim = d // config.decoder_attention_heads
        self.max_decoder_positions = config.max_target_positions
        self.max_encoder_positions = config.max_source_positions

    def encode(self, input_features: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        enc = self.encoder
        x = input_features.to(enc.conv1.weight.dtype)                     # [B, n_mels, frames]
        x = F.gelu(enc.conv1(x))                                           # [B, d, frames]
        x = F.gelu(enc.conv2(x))                                           # [B, d, frames / 2]
        # Made contiguous before the add: an add keeps its first operand's layout, so a transposed
        # sum would carry a [d, T]-strided residual stream through every layer (each residual add
        # a transposing pass, each norm a copy: ~10% of a window's encoder on 2 CPU cores).
        x = x.transpose(1, 2).contiguous()                                 # [B, T, d]
        x += enc.embed_positions.weight[:x.shape[1]]
        h = x.reshape(-1, x.shape[2])                                      # [B * T, d], packed like meta
        return run_layers(h, [functools.partial(layer, meta=meta) for layer in enc.layers], enc.layer_norm)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecoderMetadata,
               kv: KVCache) -> torch.Tensor:
        dec = self.decoder
        h = self.embed_tokens(input_ids) + dec.embed_positions(positions)  # [N, d]
        calls = [functools.partial(layer, meta=meta, self_kv=skv, cross_kv=ckv)
                 for layer, skv, ckv in zip(dec.layers, kv.self_kv, kv.cross_kv)]
        return run_layers(h, calls, dec.layer_norm)
