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
        kinds = []
        kernel = fast_linear.skinny_linear

        def spy(x, *args, **kwargs):
            kinds.extend([x.norm] if isinstance(x, Prologue) else [])
            kinds.extend([kwargs["act"]] if kwargs.get("act") else [])
            kinds.extend(["kv store"] if kwargs.get("kv_store") else [])
            return kernel(x, *args, **kwargs)

        monkeypatch.setattr(fast_linear, "skinny_linear", spy)       # projections, MLPs' first GEMV, q|k|v + store
        fused = llm.generate(_request(family), params, use_tqdm=False).outputs[0].token_ids
    assert fused == plain
    expected = {"t5_relu": {"rms", "relu"}, "flan_t5": {"rms", "gelu_tanh"}, "bart": {"gelu"},  # post-norm: no norms
                "mbart": {"layer", "relu"}, "whisper": {"layer", "gelu"}}[family]
    assert set(kinds) == expected | {"kv store"}


@pytest.mark.parametrize("family,split,norms", [("flan_t5", False, True), ("flan_t5", True, True),
                                                ("whisper", False, True), ("whisper", True, True),
                                                ("flan_t5", False, False)])
def test_tile_gemm_decodes_a_batch_to_the_same_tokens(family, split, norms, request, monkeypatch):
    """With ``tuning.tile_gemm``, a batched decode step's products (with its MLP activation, and
    with ``tile_gemm_norms`` its pre-norms) run in the tile GEMM kernel: three requests decoded
    together give the tokens they give without it; also with K split in two wherever a
    configurations file may split it (every product but a LayerNorm prologue's), the engine's
    counters and partials in play. Without the norms knob no batch's norm reaches the kernel."""
    from enc2dec.kernels import tile_gemm
    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [_request(family)] * 3 if family == "whisper" else \
        ["the quick brown fox", "jumps over the lazy dog", "a b c d e f"]
    monkeypatch.setattr(TorchAttentionBackend, "head_major_pools", False)
    with LLM(path, dtype="float32", device="cpu", attn_backend="triton", max_batch_size=4,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4)) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        fast_linear.use_skinny_linear(llm.engine.runner.model, fuse=True)
        monkeypatch.setitem(fast_linear._TILE, "on", True)
        monkeypatch.setitem(fast_linear._TILE, "norms", norms)
        acts = []
        kernel = fast_linear.tile_linear

        def spy(x, *args, **kwargs):
            acts.append(kwargs.get("act"))
            acts.extend([x.norm] if isinstance(x, Prologue) else [])
            return kernel(x, *args, **kwargs)

        monkeypatch.setattr(fast_linear, "tile_linear", spy)
        splits = []
        if split:
            rule = tile_gemm.launch_config

            def split_in_two(*args, split_ok=True, **kwargs):
                # K steps of 16, so the test models' small K makes two pieces
                config = rule(*args, split_ok=split_ok, **kwargs)
                return config[:2] + (16,) + config[3:5] + (2 if split_ok else 1,)

            launch = tile_gemm._tile_gemm_kernel
            monkeypatch.setattr(tile_gemm, "launch_config", split_in_two)
            monkeypatch.setattr(tile_gemm, "_tile_gemm_kernel", type("Spy", (), {
                "__getitem__": lambda self, grid: (splits.append(grid[2]), launch[grid])[1]})())
        tiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tiled == plain
    if split:       # split where it may: T5's RMSNorm prologues too, not Whisper's LayerNorm ones
        assert 2 in splits and (1 in splits) == (family == "whisper")
    # plain products, the MLP's activation and (with the knob) the pre-norms ran in the tile kernel
    norm = {"flan_t5": "rms", "whisper": "layer"}[family]
    assert {None, {"flan_t5": "gelu_tanh", "whisper": "gelu"}[family]} <= set(acts)
    assert (norm in acts) == norms
