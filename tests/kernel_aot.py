"""Compile the Triton kernels for a Hopper GPU on a machine without one (the CPU CI).

    python tests/kernel_aot.py            # prints one line per compiled launch, exits 1 on a failure

Each public op runs on small CPU tensors with its launches recorded instead of run (the
arguments and launch options the op would give the GPU, its own configuration choices
included), and every recorded launch is compiled with Triton's CUDA backend for sm_90 (ptxas
ships with the triton wheel), with the specialisation a real launch would get (16-byte aligned
pointers; integers divisible by 16 marked so). What this catches without a GPU: code that does
not compile for the GPU (the interpreter runs Python, not the compiler), and configurations over
the H100's 227 KiB of shared memory. Run in its own process: the interpreter (TRITON_INTERPRET=1,
which the test session sets) replaces triton.language's own jit functions at import.
"""
from __future__ import annotations

import inspect
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET (see the docstring)"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from enc2dec.kernels import lazy_jit  # noqa: E402
from launch_recorder import recorded  # noqa: E402 (tests/, the script's folder, is on sys.path)

SMEM_LIMIT = 227 * 1024          # an H100's (and H200's) shared memory a block may use
TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
         torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


def compile_launch(kernel: lazy_jit, args, kwargs):
    """Compile one recorded launch for sm_90; returns the compiled kernel's shared memory bytes."""
    fn = kernel.jitted()
    params = list(inspect.signature(kernel.fn).parameters)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k not in options}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        value = values[name]
        annotation = str(inspect.signature(kernel.fn).parameters[name].annotation)
        if "constexpr" in annotation:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0 and name not in kernel.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {value!r}")
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.metadata.shared


def _cases():
    """(label, module, call) for every op the engine runs on the GPU, at serving shapes."""
    from enc2dec.kernels import kv_store, paged_attention, skinny_gemm
    from enc2dec.kernels.skinny_gemm import Prologue

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    def t5_calls():
        # flan-t5-large's fused one-row decode projections (a scope of their own: the lambdas
        # read these names when they run, after _cases has bound others)
        d, ff, linear = 1024, 2816, skinny_gemm.skinny_linear
        x, res, gain = rand(1, d), rand(1, d), rand(d)
        pool = [torch.zeros(64, 16, 16, 64, dtype=bf) for _ in range(2)]
        slots = torch.arange(1, dtype=torch.int64)
        return [
            ("skinny_gemm q|k|v + norm + store", skinny_gemm,
             lambda: linear(Prologue(x, residual=res, norm_weight=gain), rand(3 * d, d), kv_store=(*pool, slots))),
            ("skinny_gemm gate|up + norm + gelu_tanh", skinny_gemm,
             lambda: linear(Prologue(x, residual=res, norm_weight=gain), rand(2 * ff, d), act="gelu_tanh", gated=True)),
            ("skinny_gemm down", skinny_gemm, lambda: linear(rand(1, ff), rand(d, ff))),
        ]

    cases = t5_calls()

    def cross(fp8, head_major, rows=64, keys=1500, heads=20):
        blocks, dtype = rows * 94, torch.float8_e4m3fn if fp8 else bf
        shape = (heads, blocks, 16, 64) if head_major else (blocks, 16, heads, 64)
        k, v = (torch.zeros(shape, dtype=dtype) for _ in range(2))
        scales = None
        if fp8:
            s_shape = (heads, blocks, 16) if head_major else (blocks, 16, heads)
            scales = tuple(torch.zeros(s_shape, dtype=torch.float16) for _ in range(2))
            if head_major:
                scales = tuple(s.permute(1, 2, 0) for s in scales)
        if head_major:
            k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        tables = torch.arange(blocks, dtype=torch.int32).view(rows, -1)
        lens = torch.full((rows,), keys, dtype=torch.int32)
        qsl = torch.arange(rows + 1, dtype=torch.int32)
        label = f"whisper cross attention, {'fp8' if fp8 else 'bf16'}, {'head' if head_major else 'token'}-major"
        return [(label, paged_attention, lambda: paged_attention.paged_attention(
                    rand(rows, heads, 64), k, v, qsl, lens, tables, 0.125, causal=False, num_splits=2,
                    kv_scales=scales)),
                (f"{label}, splits merged by a second kernel", paged_attention,
                 lambda: paged_attention.paged_attention(
                    rand(rows, heads, 64), k, v, qsl, lens, tables, 0.125, causal=False, num_splits=2,
                    kv_scales=scales, last_split_merges=False)),
                (f"store of {label}", kv_store, lambda: kv_store.store_kv(
                    rand(300, heads, 64), rand(300, heads, 64), k, v, torch.arange(300, dtype=torch.int64),
                    kv_scales=scales))]

    def self_store(fp8, rows=64, heads=16):
        # flan-t5-large's decode self-attention storing the new K/V itself (with the T5 bias)
        blocks, dtype = rows * 16, torch.float8_e4m3fn if fp8 else bf
        k, v = (torch.zeros(blocks, 16, heads, 64, dtype=dtype) for _ in range(2))
        scales = tuple(torch.zeros(blocks, 16, heads, dtype=torch.float16) for _ in range(2)) if fp8 else None
        tables = torch.arange(blocks, dtype=torch.int32).view(rows, -1)
        lens = torch.full((rows,), 200, dtype=torch.int32)
        qsl = torch.arange(rows + 1, dtype=torch.int32)
        qkv = rand(rows, 3, heads, 64)
        new_kv = (qkv[:, 1], qkv[:, 2], torch.arange(rows, dtype=torch.int64))
        return [(f"t5 self attention storing the new K/V, {'fp8' if fp8 else 'bf16'}", paged_attention,
                 lambda: paged_attention.paged_attention(
                    qkv[:, 0], k, v, qsl, lens, tables, 1.0, causal=True, bias_table=rand(heads, 32, dtype=torch.float32),
                    num_splits=4, kv_scales=scales, new_kv=new_kv))]

    from enc2dec.kernels import tile_gemm

    def tile_calls():
        # batched decode products (tuning.tile_gemm): flan-t5-large at 64 rows, whisper-large-v3's
        # fc1 at 128, the T5 down projection at 256, a float32 model's
        d, ff, tile = 1024, 2816, tile_gemm.tile_linear
        rms = Prologue(rand(64, d), residual=rand(64, d), norm_weight=rand(d))
        layer = Prologue(rand(64, 1280), residual=rand(64, 1280), norm="layer", norm_weight=rand(1280),
                         norm_bias=rand(1280))
        return [("tile_gemm q|k|v, 64 rows", tile_gemm, lambda: tile(rand(64, d), rand(3 * d, d))),
                ("tile_gemm q|k|v + RMSNorm + residual, 64 rows", tile_gemm, lambda: tile(rms, rand(3 * d, d))),
                ("tile_gemm whisper fc1 + LayerNorm + residual + gelu, 64 rows", tile_gemm,
                 lambda: tile(layer, rand(5120, 1280), rand(5120), act="gelu")),
                ("tile_gemm gate|up + gelu_tanh, 64 rows", tile_gemm,
                 lambda: tile(rand(64, d), rand(2 * ff, d), act="gelu_tanh", gated=True)),
                ("tile_gemm down, 256 rows", tile_gemm, lambda: tile(rand(256, ff), rand(d, ff))),
                ("tile_gemm whisper fc1 + bias + gelu, 128 rows", tile_gemm,
                 lambda: tile(rand(128, 1280), rand(5120, 1280), rand(5120), act="gelu")),
                ("tile_gemm down split over K in 4, 64 rows", tile_gemm,
                 lambda: tile(rand(64, ff), rand(d, ff), config=(64, 64, 128, 4, 3, 4))),
                ("tile_gemm gate|up + gelu_tanh split over K in 2, 64 rows", tile_gemm,
                 lambda: tile(rand(64, d), rand(2 * ff, d), act="gelu_tanh", gated=True, config=(64, 64, 128, 4, 3, 2))),
                ("tile_gemm q|k|v + RMSNorm + residual split over K in 2, 64 rows", tile_gemm,
                 lambda: tile(rms, rand(3 * d, d), config=(64, 64, 128, 4, 2, 2))),
                ("tile_gemm float32, 24 rows", tile_gemm,
                 lambda: tile(rand(24, 512, dtype=torch.float32), rand(512, 512, dtype=torch.float32)))]

    cases += tile_calls()
    for fp8 in (False, True):
        for head_major in (False, True):
            cases += cross(fp8, head_major)
        cases += self_store(fp8)

    from enc2dec.kernels import activations, norms, sampling
    x, res = rand(64, 1024), rand(64, 1024)
    cases += [("add + RMSNorm", norms, lambda: norms.fused_add_rms_norm(x, res, rand(1024), 1e-6)),
              ("add + LayerNorm", norms, lambda: norms.fused_add_layer_norm(x, res, rand(1024), rand(1024), 1e-5)),
              ("gelu", activations, lambda: activations.gelu(rand(64, 5120))),
              ("gated gelu", activations, lambda: activations.gated_gelu(rand(64, 2 * 2816)))]
    scores = torch.randn(64, 51866, generator=g)
    keys = torch.randint(0, 2 ** 31, (64, 3), generator=g)
    filters = (torch.full((64,), -float("inf")), torch.full((64,), 0.95), torch.zeros(64))
    cases += [("gumbel race", sampling, lambda: sampling.gumbel_race(scores, keys[:8], keys[8:])),
              ("filtered race, one program a row", sampling,
               lambda: sampling.filtered_race(scores, *filters, keys[:8], keys[8:], splits=1)),
              ("filtered race, split rows", sampling,
               lambda: sampling.filtered_race(scores, *filters, keys[:8], keys[8:], splits=4))]
    return cases


def main() -> int:
    failed = 0
    for label, module, call in _cases():
        with recorded(module) as launches:
            call()
        # Each launch as recorded and, for a kernel that can wait for the one before it
        # (programmatic launch, which CPU tensors never ask for), with its PDL constexpr on.
        variants = [(name, kernel, args, kwargs, "") for name, kernel, args, kwargs in launches]
        variants += [(name, kernel, args, kwargs | {"PDL": True}, ", PDL") for name, kernel, args, kwargs in launches
                     if "PDL" in kwargs]
        for name, kernel, args, kwargs, tag in variants:
            try:
                smem = compile_launch(kernel, args, kwargs)
            except Exception as e:  # noqa: BLE001 - report every failure, not only the first
                print(f"FAIL {label}{tag}: {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                failed += 1
                continue
            verdict = "ok" if smem <= SMEM_LIMIT else "FAIL shared memory over the H100's"
            failed += smem > SMEM_LIMIT
            print(f"{verdict} {label}{tag}: {name} ({smem} B shared)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
