"""The fused decode GEMV end to end, on the CPU through Triton's interpreter (TRITON_INTERPRET=1,
set by conftest): with every pre-norm deferred into the skinny GEMV that reads it
(``kernels/skinny_gemm.Prologue``) and every MLP activation done in the GEMV before it
(``engine/runner/fast_linear.py`` rewrites the model's modules), one request decodes the same greedy tokens as the separate
kernels, for every family, and the fusions really run."""
import numpy as np
import pytest

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.models.torch_attention import TorchAttentionBackend
from enc2dec.engine.runner import fast_linear
from enc2dec.kernels.skinny_gemm import Prologue

pytest.importorskip("triton")


def _request(family):
    if family == "whisper":
        wave = (np.random.RandomState(0).randn(16000 * 2) * 0.1).astype(np.float32)
        return {"prompt": "", "multi_modal_data": {"audio": [(wave, 16000)]}}
    return "the quick brown fox jumps over"


def spy_fusions(monkeypatch, kernel_name):
    """Wrap fast_linear's ``kernel_name``: the returned list collects the fusions its calls carry
    (the deferred norm's kind, the activation, "kv store")."""
    kinds = []
    kernel = getattr(fast_linear, kernel_name)

    def spy(x, *args, **kwargs):
        kinds.extend([x.norm] if isinstance(x, Prologue) else [])
        kinds.extend([kwargs["act"]] if kwargs.get("act") else [])
        kinds.extend(["kv store"] if kwargs.get("kv_store") else [])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(fast_linear, kernel_name, spy)
    return kinds


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "mbart", "whisper"])
def test_fused_norms_and_activations_decode_the_same_tokens(family, request, monkeypatch):
    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # The GEMV's K/V-store epilogue writes token-major pools (the GPU's layout); the CPU's torch
    # backend would store them head-major, where the store stays a separate op.
    monkeypatch.setattr(TorchAttentionBackend, "head_major_pools", False)
    with LLM(path, dtype="float32", device="cpu", attn_backend="triton", max_batch_size=2,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4)) as llm:
        plain = llm.generate(_request(family), params, use_tqdm=False).outputs[0].token_ids
        fast_linear.use_skinny_linear(llm.engine.runner.model, fuse=True)
        kinds = spy_fusions(monkeypatch, "skinny_linear")        # projections, MLPs' first GEMV, q|k|v + store
        fused = llm.generate(_request(family), params, use_tqdm=False).outputs[0].token_ids
    assert fused == plain
    expected = {"t5_relu": {"rms", "relu"}, "flan_t5": {"rms", "gelu_tanh"}, "bart": {"gelu"},  # post-norm: no norms
                "mbart": {"layer", "relu"}, "whisper": {"layer", "gelu"}}[family]
    assert set(kinds) == expected | {"kv store"}


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "whisper"])
def test_tile_gemm_decodes_a_batch_the_same_tokens(family, request, monkeypatch):
    # tuning.tile_gemm: decode steps of several rows take the decoder layers' fusions through
    # the tile GEMM (T5's RMSNorms folded into the product, activations, the K/V store; BART's
    # and Whisper's LayerNorms stay their own kernels), the same greedy tokens as without it.
    from enc2dec.kernels import tile_gemm

    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(TorchAttentionBackend, "head_major_pools", False)
    prompts = [_request(family)] * 3 if family == "whisper" else \
        ["the quick brown fox jumps over", "a b c", "translate English to German: hello there, friend"]
    with LLM(path, dtype="float32", device="cpu", attn_backend="triton", max_batch_size=4,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4)) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        fast_linear.use_skinny_linear(llm.engine.runner.model, fuse=True, tile_rows=256)
        kinds = spy_fusions(monkeypatch, "tile_linear")
        launches = []
        launch = tile_gemm._tile_gemm_kernel
        monkeypatch.setattr(tile_gemm, "_tile_gemm_kernel", type("Spy", (), {
            "__getitem__": lambda self, grid: (launches.append(grid), launch[grid])[1]})())
        tiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tiled == plain
    expected = {"t5_relu": {"rms", "relu"}, "flan_t5": {"rms", "gelu_tanh"}, "bart": {"gelu"},
                "whisper": {"gelu"}}[family]                          # no LayerNorm folds into the tile GEMM
    assert set(kinds) == expected | {"kv store"} and launches


@pytest.mark.parametrize("family", ["flan_t5", "bart", "whisper"])
def test_encoder_mlps_in_the_tile_gemm_encode_the_same(family, request, monkeypatch):
    # tuning.tile_gemm_encoder: an encoder layer's MLP runs its first projection and activation
    # (gated for flan-T5, erf-GELU with bias for BART and Whisper) as one tile GEMM over the
    # whole batch of encoder positions; the greedy tokens are those of the library GEMM path.
    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(TorchAttentionBackend, "head_major_pools", False)
    prompts = [_request(family)] * 2 if family == "whisper" else ["the quick brown fox jumps over", "a b c"]
    with LLM(path, dtype="float32", device="cpu", attn_backend="triton", max_batch_size=2,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4)) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        fast_linear.use_skinny_linear(llm.engine.runner.model, fuse=True, encoder_tile=True)
        rows = []
        kernel = fast_linear.tile_linear

        def spy(x, *args, **kwargs):
            rows.append(x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1])
            return kernel(x, *args, **kwargs)

        monkeypatch.setattr(fast_linear, "tile_linear", spy)
        tiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tiled == plain
    assert rows and max(rows) > 2              # encoder batches (a decode step has at most 2 rows here)
