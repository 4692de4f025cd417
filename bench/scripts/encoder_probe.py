"""Where a Whisper encoder's time goes on the GPU: the engine's encoder (encode + cross K/V
write) replayed as a CUDA graph at 1, 2 and 4 clips, its kernels grouped by kind at one clip,
the attention under each SDPA backend, and transformers' encoder under torch.compile beside it.

    python bench/scripts/encoder_probe.py --model openai/whisper-large-v3-turbo

A diagnosis tool (issue 17's turbo target is bound by the encoder); claims come from `enc2dec bench`.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from enc2dec.engine import LLM, KvCacheConfig, LlmArgs
from enc2dec.engine.runner.cuda_graph import uniform_encoder_batch


def timed(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` over ``reps`` calls, each timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("flash", "attention"), ("fmha", "attention"), ("cudnn", "cudnn"), ("attention", "attention"),
                       ("conv", "conv"), ("gemm", "gemm"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"),
                       ("layer_norm", "layernorm"), ("gelu", "gelu"), ("elementwise", "elementwise"),
                       ("copy", "copy"), ("scatter", "kv write"), ("store", "kv write")):
        if key in n:
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="openai/whisper-large-v3-turbo")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--blas", default="cublas",
                    help="comma list of torch.backends.cuda.preferred_blas_library values to time the engine's "
                         "encoder and one layer's GEMMs under (each graph captured under its library)")
    a = ap.parse_args()
    libraries = a.blas.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    llm = LLM.from_args(LlmArgs.from_dict({"cuda_graph_config": None, "encoder_cuda_graph_config": None},
                                          model=a.model, load_format="dummy", dtype="bfloat16",
                                          kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)))
    runner = llm.engine.runner
    model, kv, dev = runner.model, runner.kv, torch.device("cuda")
    cfg = llm.engine.hf_config
    n_pos, d, heads = cfg.max_source_positions, cfg.d_model, cfg.encoder_attention_heads
    layers = cfg.encoder_layers
    flop_clip = layers * (2 * n_pos * d * (4 * d + 2 * cfg.encoder_ffn_dim) + 4 * n_pos * n_pos * d) \
        + 2 * (2 * n_pos) * d * cfg.num_mel_bins * 3 + 2 * n_pos * d * d * 3
    print(f"{a.model}: {layers} encoder layers, d {d}, {heads} heads, {flop_clip / 1e12:.3f} TFLOP a clip")
    rows = []
    with torch.inference_mode():
        for lib, b in ((lib, b) for lib in libraries for b in batches):
            torch.backends.cuda.preferred_blas_library(lib)
            inputs, meta = uniform_encoder_batch(b, n_pos, dev, torch.bfloat16, whisper_mels=cfg.num_mel_bins)
            enc_only = graphed(lambda: model.encode(inputs, dataclasses.replace(meta)))
            both = graphed(lambda: model.write_cross_kv(model.encode(inputs, dataclasses.replace(meta)), meta, kv))
            t_enc, t_both = timed(enc_only), timed(both)
            rows.append((f"{lib} {b}", t_enc / b, t_both / b))
            print(f"engine {lib} B={b}: encode {t_enc:.2f} ms ({t_enc / b:.2f}/clip, {flop_clip * b / t_enc / 1e9:.0f} "
                  f"TFLOP/s), + cross K/V {t_both:.2f} ms ({t_both / b:.2f}/clip)", flush=True)
            if b == batches[0] and lib == libraries[0]:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        both()
                    torch.cuda.synchronize()
                by = collections.defaultdict(lambda: [0, 0.0])
                names = collections.defaultdict(lambda: [0, 0.0])
                for ev in prof.events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        us = getattr(ev, "device_time_total", 0.0)
                        by[kind(ev.name)][0] += 1
                        by[kind(ev.name)][1] += us
                        names[ev.name[:100]][0] += 1
                        names[ev.name[:100]][1] += us
                tot = sum(v[1] for v in by.values())
                for k, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
                    print(f"  {k:<12} {n / 5:>6.0f} kernels/clip {us / 5e3:>7.3f} ms {100 * us / tot:>5.1f}%")
                for nm, (n, us) in sorted(names.items(), key=lambda kv: -kv[1][1])[:14]:
                    print(f"    {us / 5e3:>7.3f} ms {n / 5:>5.0f}x  {nm}")
            del enc_only, both
            torch.cuda.empty_cache()
        # attention alone, one layer's shape, each SDPA backend
        for b in batches:
            q, k, v = (torch.randn(b, heads, n_pos, d // heads, device=dev, dtype=torch.bfloat16) for _ in range(3))
            line = []
            for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                try:
                    with sdpa_kernel([be]):
                        t = timed(lambda: F.scaled_dot_product_attention(q, k, v))
                    line.append(f"{be.name} {t * 1e3:.0f} us ({4 * b * n_pos * n_pos * d / t / 1e9:.0f} TF/s)")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{be.name} failed {type(e).__name__}")
            print(f"sdpa B={b}: " + ", ".join(line), flush=True)
        # GEMMs of one layer at each batch
        for lib, b in ((lib, b) for lib in libraries for b in batches):
            torch.backends.cuda.preferred_blas_library(lib)
            m = b * n_pos
            x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
            parts = []
            for n_out, k_in in ((3 * d, d), (d, d), (cfg.encoder_ffn_dim, d), (d, cfg.encoder_ffn_dim)):
                w = torch.randn(n_out, k_in, device=dev, dtype=torch.bfloat16)
                xi = x if k_in == d else torch.randn(m, k_in, device=dev, dtype=torch.bfloat16)
                t = timed(lambda: F.linear(xi, w))
                parts.append(f"{n_out}x{k_in} {t * 1e3:.0f}us/{2 * m * n_out * k_in / t / 1e9:.0f}TF")
            print(f"gemm {lib} M={m}: " + " ".join(parts), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    llm.shutdown()
    if a.no_hf:
        return
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    hf_cfg = WhisperConfig(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures",)})
    hf_cfg._attn_implementation = "sdpa"
    enc = WhisperEncoder(hf_cfg).to(dev, torch.bfloat16).eval()
    compiled = torch.compile(enc)
    with torch.inference_mode():
        for b in batches:
            feats = torch.randn(b, cfg.num_mel_bins, 2 * n_pos, device=dev, dtype=torch.bfloat16)
            t_eager = timed(lambda: enc(feats), reps=10)
            t_comp = timed(lambda: compiled(feats), reps=10)
            print(f"hf encoder B={b}: eager {t_eager:.2f} ms ({t_eager / b:.2f}/clip), compiled {t_comp:.2f} ms "
                  f"({t_comp / b:.2f}/clip)", flush=True)
    print("\nBLAS, B  engine encode ms/clip  + cross K/V ms/clip")
    for label, t_enc, t_both in rows:
        print(f"{label:<12}  {t_enc:>8.2f}  {t_both:>8.2f}")


if __name__ == "__main__":
    main()
