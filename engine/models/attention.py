"""Attention metadata, the paged KV cache tensors and the torch reference backend.

Models call a backend through four functions and never look at block tables
themselves:

    backend.encoder_attention(q, k, v, meta, scale, bias_table)   # packed, bidirectional
    backend.store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)       # write new K/V into slots
    backend.self_attention(q, k_cache, v_cache, meta, scale, bias_table, kv_scales, new_kv)   # causal, paged
                                                        # (new_kv: the new tokens' (k, v), stored first)
    backend.cross_attention(q, k_cache, v_cache, meta, scale, kv_scales)    # over the request's encoder K/V

``kv_scales`` is None, or an FP8 pool's (k_scale, v_scale) (``LayerKV.scales``).

Cache layout, per layer and per pool: ``[num_blocks, tokens_per_block, num_heads, head_dim]``
(FP8 pools add float16 scales ``[num_blocks, tokens_per_block, num_heads]``).
Slot ``s`` is block ``s // tokens_per_block``, offset ``s % tokens_per_block``.

T5 relative bias tables (the bucketing is done by the model, once):
  encoder: ``[num_heads, 2 * L - 1]``, bias(q_pos, k_pos) = table[:, k_pos - q_pos + L - 1]
  decoder: ``[num_heads, L]``, bias(q_pos, k_pos) = table[:, q_pos - k_pos] (causal, so >= 0)
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from enc2dec.engine.config import canonical_backend_name
from enc2dec.engine.models.torch_attention import TorchAttentionBackend, gather_blocks  # noqa: F401 (re-exported)


@dataclass
class EncoderMetadata:
    """A packed encoder microbatch of ``B`` requests.

    Padded layout (encoder CUDA graphs): every sequence occupies ``L`` tokens (``seq_lens`` is
    ``[L] * B``, ``cu_seqlens`` steps by ``L``) and ``padded_lens`` holds the real lengths on
    the device; keys past a sequence's real length are masked, the padding tokens' outputs are
    garbage and their cross slots are -1 (never stored)."""

    cu_seqlens: torch.Tensor          # [B + 1] int32, on device
    seq_lens: list[int]               # host copy
    positions: torch.Tensor | None    # [num_tokens] int64 (text encoders), None for Whisper
    cross_slot_mapping: torch.Tensor  # [num_tokens] int64: cross-pool slot of every encoder position
    padded_lens: torch.Tensor | None = None   # [B] int32 real lengths, padded layout only

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


@dataclass
class DecoderMetadata:
    """A flat decoder batch of ``S`` sequences with ``N`` new tokens in all."""

    query_start_loc: torch.Tensor     # [S + 1] int32: sequence i's new tokens are q[qsl[i]:qsl[i+1]]
    seq_lens: torch.Tensor            # [S] int32: context length including the new tokens
    block_tables: torch.Tensor        # [S, max_blocks] int32, self pool (padded with 0)
    slot_mapping: torch.Tensor        # [N] int64: self-pool slot of each new token
    cross_block_tables: torch.Tensor  # [S, max_cross_blocks] int32, cross pool
    enc_lens: torch.Tensor            # [S] int32
    query_lens_host: list[int]
    seq_lens_host: list[int]
    enc_lens_host: list[int]
    last_token_indices: torch.Tensor  # [S] int64: index into the N tokens of each sequence's last token


@dataclass
class LayerKV:
    # [num_blocks, tokens_per_block, num_heads, head_dim] as indexed; stored head-major for the
    # torch backend (``KVCache.allocate``), so only the strides say which layout it is.
    k: torch.Tensor
    v: torch.Tensor
    # FP8 pools: the float16 scale of every stored (position, head) row, [num_blocks, tokens_per_block, num_heads]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the backends take as ``kv_scales``: None for a pool in the model's dtype."""
        return None if self.k_scale is None else (self.k_scale, self.v_scale)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block (what a block copy must copy)."""
        return [self.k, self.v] + ([] if self.k_scale is None else [self.k_scale, self.v_scale])


# CPU pools from this size up are anonymous memory maps rather than torch.zeros.
LAZY_POOL_MIN_BYTES = 1 << 20


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed pool tensor. On the CPU a large one is an anonymous memory map: the kernel hands
    out zero pages on first write, so a pool costs nothing at start-up (torch.zeros wrote all of
    a 2 GiB budget in 0.45 s on two cores) and memory only for the blocks that get used."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_POOL_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # frombuffer keeps the map alive as long as the tensor; pages are aligned for any dtype.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class KVCache:
    """Both pools for every decoder layer."""

    self_kv: list[LayerKV]
    cross_kv: list[LayerKV]

    @property
    def tokens_per_block(self) -> int:
        return self.self_kv[0].k.shape[1]

    @staticmethod
    def allocate(num_layers: int, num_heads: int, head_dim: int, tokens_per_block: int,
                 num_self_blocks: int, num_cross_blocks: int, dtype, device, fp8: bool = False,
                 head_major: bool = False, cross_head_major: bool | None = None) -> "KVCache":
        """``fp8``: e4m3 pools with float16 scales (``kv_cache_config.dtype="fp8"``), else ``dtype``.

        ``head_major``: each pool is stored [num_heads, num_blocks, tokens_per_block, head_dim] and
        handed out as the permuted view with the usual shape. A request's consecutive blocks then
        hold each head's keys as one contiguous run, which a CPU decode step's attention streams
        (token-major, a head's 64 values sit 2 KB apart: whisper-base's cross-attention over 1500
        positions at 6 rows took 17.5 ms a step against 13.1 head-major, on 2 cores).
        ``cross_head_major`` (default: ``head_major``) sets the cross pools' layout alone: the
        Triton kernels take any strides, but the fused GEMV's self K/V store needs token-major
        self pools (``tuning.cross_kv_head_major``). FP8 pools (their scale pools with them) are
        head-major only when ``cross_head_major`` says so."""
        from enc2dec.kernels.reference import FP8_SCALE_DTYPE

        def pool(n, pool_dtype, major, *tail):
            """[n, tokens_per_block, num_heads, *tail], stored heads first when ``major``."""
            if major:
                return pool_zeros((num_heads, n, tokens_per_block, *tail), pool_dtype, device).movedim(0, 2)
            return pool_zeros((n, tokens_per_block, num_heads, *tail), pool_dtype, device)

        def layer(n, major):
            if not fp8:
                return LayerKV(pool(n, dtype, major, head_dim), pool(n, dtype, major, head_dim))
            # Each scale pool follows its values: a head-major decode program reads its head's
            # scales as one run too, not one 2-byte value per 32-byte sector.
            return LayerKV(*(pool(n, torch.float8_e4m3fn, major, head_dim) for _ in range(2)),
                           *(pool(n, FP8_SCALE_DTYPE, major) for _ in range(2)))

        head_major = head_major and not fp8          # the torch backend reads FP8 pools token-major
        cross_major = head_major if cross_head_major is None else cross_head_major
        return KVCache([layer(num_self_blocks, head_major) for _ in range(num_layers)],
                       [layer(num_cross_blocks, cross_major) for _ in range(num_layers)])


def get_attention_backend(name: str, min_keys_per_split: int = 32, last_split_merges: bool = True,
                          store_in_kernel: bool = True):
    """``min_keys_per_split``, ``last_split_merges``, ``store_in_kernel``: the triton backend's
    options (``TuningConfig``)."""
    name = canonical_backend_name(name)
    if name == "torch":
        return TorchAttentionBackend()
    from enc2dec.kernels.backend import TritonAttentionBackend  # lazy: triton is optional
    return TritonAttentionBackend(min_keys_per_split, last_split_merges, store_in_kernel)
