"""The Triton add+norm and gated-gelu kernels, applied to a model from outside.

``use_triton_norms(model)`` gives every ``RMSNorm`` / ``LayerNorm`` and every tanh-gelu
``GatedMLP`` of the model (exact classes only) a subclass whose forward launches one
kernel where the eager model runs five or more (``kernels/norms.py``,
``kernels/activations.py``; same math, fp32 inside). The model runner applies it on CUDA,
whatever the attention backend; a kernel falls back to its torch reference where Triton
cannot run the tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.layers import GatedMLP, LayerNorm, RMSNorm, clamp_fp16, gelu_tanh
from enc2dec.kernels.activations import gated_gelu
from enc2dec.kernels.norms import fused_add_layer_norm, fused_add_rms_norm


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float16:    # transformers' clamp sits between the add and the norm
            h = clamp_fp16(residual + x)
            return fused_add_rms_norm(h, None, self.weight, self.eps)[0], h
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class TritonLayerNorm(LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_add_layer_norm(x, None, self.weight, self.bias, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float16:    # the clamp between add and norm; the norm stays torch's
            h = clamp_fp16(residual + x)
            return F.layer_norm(h, self.normalized_shape, self.weight, self.bias, self.eps), h
        return fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)


class TritonGatedMLP(GatedMLP):
    """``gelu_tanh(gate) * up`` in one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gated_gelu(self.gate_up(x), approximate="tanh"))   # gate_up: [T, 2 * d_ff / tp]


_TRITON_CLASSES = {RMSNorm: TritonRMSNorm, LayerNorm: TritonLayerNorm}


def use_triton_norms(model: nn.Module) -> int:
    """Swap the classes of the model's norms and tanh-gelu gated MLPs; returns how many."""
    count = 0
    for module in model.modules():
        cls = _TRITON_CLASSES.get(type(module))
        if cls is None and type(module) is GatedMLP and module.act is gelu_tanh:
            cls = TritonGatedMLP
        if cls is not None:
            module.__class__ = cls
            count += 1
    return count
