"""FP8 KV against bf16 KV on the tiny random text checkpoints (issue 19's accuracy rule), on the CPU.

Each checkpoint of ``tests/tiny_models.py`` (bf16 weights, CPU, torch backend) decodes the same
prompts greedily, once with bf16 pools and once with FP8 pools, 16 tokens each (EOS ignored, so
every input is judged on 16 tokens), and the script counts the inputs whose first 16 tokens are
identical (the rule: at least 95%). On the CPU the two runs differ in more than the pools: bf16
pools are read by ``scaled_dot_product_attention`` in bf16, FP8 pools by the fp32 reference, so
the count is also given against bf16 pools read by the reference (the GPU's situation, where
one Triton kernel reads both).

``--diagnose`` adds, per checkpoint, where the flips come from:

* controls: bf16 pools read through the attention reference (fp32 math, the path FP8 pools take
  on the CPU) and a second plain bf16 run (determinism), each against the bf16 run;
* FP8 in one pool only (self or cross), and in one layer of one pool only;
* the bf16 run's top-1 / top-2 log-probability margin at every step, against the step where an
  FP8 run first differs;
* at every attention call of the FP8 run, the scores' and outputs' error against the same call
  over unquantised (bf16) copies of the pools;
* other row formats over the same per-(position, head) scales, emulated (float32 pools holding
  what each format dequantises to, cross keys centred as for FP8): float32 (no rounding: the
  runs' common truth), bf16 itself (the centring's rounding alone), e4m3 (today's FP8, checks
  the emulation), e4m3 in the keys only or the values only, and int8.

    python bench/scripts/fp8_kv_tiny.py [--families flan_t5 bart] [--prompts 40] [--diagnose]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import tempfile

FIRST_TOKENS = 16
TEXT_FAMILIES = ("bart", "mbart", "t5_relu", "flan_t5", "byt5")


def tiny_prompts(path: str, n: int, seed: int) -> list[dict]:
    """``n`` encoder inputs of 3-24 random non-special token ids, with the tokenizer's own
    specials around them. Ids, not text: the tiny tokenizers are retrained at every build and
    their float scores differ in the last bits, which can change how a text splits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    special = set(tok.all_special_ids)
    pool = [i for i in range(len(tok)) if i not in special]
    empty = list(tok("")["input_ids"])                 # the specials of an empty text: [eos] or [bos, eos]
    head, tail = (empty[:1], empty[1:]) if len(empty) == 2 else ([], empty)
    rng = random.Random(seed)
    return [{"prompt_token_ids": head + [rng.choice(pool) for _ in range(rng.randint(3, 24))] + tail}
            for _ in range(n)]


def build_checkpoint(family: str, root: pathlib.Path) -> str:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import build

    return build(family, str(root / family))


def decode(path: str, prompts: list[dict], *, fp8=False, only=None, ref_path=False, probe=None, logprobs=None,
           emulate=None):
    """Greedy token ids (and top-2 logprobs) of every prompt.

    ``fp8``: FP8 pools; ``only`` a set of ("self" | "cross", layer) keeps FP8 in just those
    pools (the others are swapped for bf16 ones before any request). ``ref_path``: bf16 pools
    read through the attention reference. ``probe``: a ``ScoreProbe`` class watching every
    attention call. ``emulate``: a name of ``EMULATED``: every pool float32, holding each row
    as that format dequantises it (scales of 1, so cross keys are still centred as for FP8,
    and attention is the reference's). These reach into the engine's runner: a diagnostic,
    not an API.
    """
    import torch

    from enc2dec.engine import LLM, SamplingParams
    from enc2dec.engine.models.attention import LayerKV

    with LLM(path, dtype="bfloat16", device="cpu", max_batch_size=64,
             kv_cache_config={"dtype": "fp8" if fp8 or emulate else "auto", "cross_kv_cache_fraction": 0.5}) as llm:
        runner = llm._core.runner
        if emulate is not None:
            _emulate(runner, EMULATED[emulate])
        if only is not None:
            for pool in ("self", "cross"):
                layers = getattr(runner.kv, f"{pool}_kv")
                for i, lkv in enumerate(layers):
                    if (pool, i) not in only:
                        layers[i] = LayerKV(torch.zeros(lkv.k.shape, dtype=torch.bfloat16),
                                            torch.zeros(lkv.v.shape, dtype=torch.bfloat16))
        if ref_path:
            _read_through_reference(runner.backend)
        watcher = probe(runner) if probe is not None else None
        params = SamplingParams(max_tokens=FIRST_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        lps = [o.outputs[0].logprobs for o in outs] if logprobs else None
        return ids, lps, watcher


def _read_through_reference(backend) -> None:
    from enc2dec.kernels.reference import paged_attention_ref

    backend.self_attention = lambda q, kc, vc, meta, scale, bias_table=None, kv_scales=None: paged_attention_ref(
        q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, causal=True,
        bias_table=bias_table, kv_scales=kv_scales)
    backend.cross_attention = lambda q, kc, vc, meta, scale, kv_scales=None: paged_attention_ref(
        q, kc, vc, meta.query_start_loc, meta.enc_lens, meta.cross_block_tables, scale, causal=False,
        kv_scales=kv_scales)


def _e4m3(x):
    from enc2dec.kernels.reference import dequantize_ref, quantize_fp8_ref

    return dequantize_ref(*quantize_fp8_ref(x))


def _int8(x):
    # int8 over the same float16 scale per (position, head): amax / 127, round to nearest
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=2.0 ** -14).half().float()
    return (xf / scale).round().clamp(-127, 127) * scale


def _bf16(x):
    return x.bfloat16().float()


def _fp32(x):
    return x.float()


# name -> (key format, value format)
EMULATED = {"fp32": (_fp32, _fp32), "bf16": (_bf16, _bf16), "e4m3": (_e4m3, _e4m3), "int8": (_int8, _int8),
            "e4m3_keys_only": (_e4m3, _bf16), "e4m3_values_only": (_bf16, _e4m3)}


def _emulate(runner, fmt) -> None:
    import torch

    from enc2dec.engine.models.attention import LayerKV
    from enc2dec.kernels.reference import store_kv_ref

    for pool in ("self", "cross"):
        layers = getattr(runner.kv, f"{pool}_kv")
        for i, lkv in enumerate(layers):
            ones = torch.ones(lkv.k_scale.shape, dtype=lkv.k_scale.dtype)
            layers[i] = LayerKV(torch.zeros(lkv.k.shape), torch.zeros(lkv.v.shape), ones, ones.clone())
    _read_through_reference(runner.backend)
    k_fmt, v_fmt = fmt
    runner.backend.store_kv = lambda k, v, kc, vc, slots, kv_scales=None: store_kv_ref(
        k_fmt(k), v_fmt(v), kc, vc, slots)


def _scores(q, k_cache, kv_scales, qsl, kv_lens, block_tables, scale, causal, bias_table):
    """The reference's pre-softmax scores [N, H, K] and which are visible [N, K] (one step's queries)."""
    import torch

    from enc2dec.kernels.reference import dequantize_ref, token_seq_index

    n, tpb = q.shape[0], k_cache.shape[1]
    seq = token_seq_index(qsl, n).clamp(max=kv_lens.shape[0] - 1)
    qsl = qsl.long()
    kv_len = kv_lens.long()[seq]
    q_pos = kv_len - (qsl[seq + 1] - qsl[seq]) + (torch.arange(n) - qsl[seq])
    k_pos = torch.arange(block_tables.shape[1] * tpb)
    pages = block_tables.long()[seq][:, k_pos // tpb]
    k_scale = None if kv_scales is None else kv_scales[0]
    k = dequantize_ref(k_cache[pages, k_pos % tpb], None if k_scale is None else k_scale[pages, k_pos % tpb])
    s = torch.einsum("nhd,nkhd->nhk", q.float(), k) * scale
    if bias_table is not None:
        rel = (q_pos[:, None] - k_pos[None, :]).clamp(0, bias_table.shape[1] - 1)
        s = s + bias_table.float()[:, rel].transpose(0, 1)
    visible = k_pos[None, :] < (q_pos + 1 if causal else kv_len)[:, None]
    return s, visible


class ScoreProbe:
    """Keeps bf16 copies of everything stored into the FP8 pools and, at each attention call,
    measures the FP8 call against the same call over the copies, per (pool, layer)."""

    def __init__(self, runner):
        import torch

        self.backend = runner.backend
        self.where, self.pools, self.shadow = {}, {}, {}
        for pool in ("self", "cross"):
            for i, lkv in enumerate(getattr(runner.kv, f"{pool}_kv")):
                self.where[id(lkv.k)] = (pool, i)
                self.pools[(pool, i)] = lkv
                self.shadow[id(lkv.k)] = (torch.zeros(lkv.k.shape, dtype=torch.bfloat16),
                                          torch.zeros(lkv.v.shape, dtype=torch.bfloat16))
        self.stats: dict[tuple[str, int], list[dict]] = {}
        store, self_attn, cross_attn = self.backend.store_kv, self.backend.self_attention, self.backend.cross_attention

        def store_kv(k, v, kc, vc, slots, kv_scales=None):
            from enc2dec.kernels.reference import store_kv_ref

            store(k, v, kc, vc, slots, kv_scales)
            if id(kc) in self.shadow:
                store_kv_ref(k, v, *self.shadow[id(kc)], slots)

        def self_attention(q, kc, vc, meta, scale, bias_table=None, kv_scales=None):
            out = self_attn(q, kc, vc, meta, scale, bias_table, kv_scales)
            self._measure(q, kc, vc, kv_scales, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                          scale, True, bias_table, out)
            return out

        def cross_attention(q, kc, vc, meta, scale, kv_scales=None):
            out = cross_attn(q, kc, vc, meta, scale, kv_scales)
            self._measure(q, kc, vc, kv_scales, meta.query_start_loc, meta.enc_lens, meta.cross_block_tables,
                          scale, False, None, out)
            return out

        self.backend.store_kv, self.backend.self_attention = store_kv, self_attention
        self.backend.cross_attention = cross_attention

    def _measure(self, q, kc, vc, kv_scales, qsl, kv_lens, tables, scale, causal, bias, out):
        import torch

        from enc2dec.kernels.reference import paged_attention_ref

        if kv_scales is None or id(kc) not in self.shadow:
            return
        sk, sv = self.shadow[id(kc)]
        s8, vis = _scores(q, kc, kv_scales, qsl, kv_lens, tables, scale, causal, bias)
        s, _ = _scores(q, sk, None, qsl, kv_lens, tables, scale, causal, bias)
        m = vis[:, None, :].expand_as(s)
        err = (s8 - s)[m]
        spread = torch.stack([s[i, h][vis[i]].std() for i in range(s.shape[0]) for h in range(s.shape[1])
                              if int(vis[i].sum()) > 1]) if int(vis.sum(1).max()) > 1 else torch.zeros(1)
        p8 = torch.softmax(s8.masked_fill(~m, float("-inf")), -1)
        p = torch.softmax(s.masked_fill(~m, float("-inf")), -1)
        exact = paged_attention_ref(q, sk, sv, qsl, kv_lens, tables, scale, causal=causal, bias_table=bias).float()
        self.stats.setdefault(self.where[id(kc)], []).append({
            "score_abs": float(s[m].abs().mean()), "score_spread": float(spread.mean()),
            "score_err_rms": float(err.pow(2).mean().sqrt()), "score_err_max": float(err.abs().max()),
            "prob_err_max": float((p8 - p).abs().nan_to_num(0.0).max()),
            "out_rel_err": float((out.float() - exact).norm() / exact.norm().clamp(min=1e-12))})

    def summary(self) -> dict:
        return {f"{pool}[{i}]": {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
                for (pool, i), rows in sorted(self.stats.items())}


def same_first(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x[:FIRST_TOKENS] == y[:FIRST_TOKENS] for x, y in zip(a, b))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)


def margins(lps) -> list[list[float]]:
    """The top-1 minus top-2 log-probability of every step of every input (the bf16 run's)."""
    out = []
    for steps in lps:
        row = []
        for d in steps:
            top = sorted(d.values(), reverse=True)
            row.append(top[0] - top[1])
        out.append(row)
    return out


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {f"p{int(q * 100)}": xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.01, 0.05, 0.1, 0.25, 0.5)}


def diagnose(path: str, prompts: list[dict], ids_bf16, lps_bf16, num_layers: int) -> dict:
    rep: dict = {}
    ids_again, _, _ = decode(path, prompts)
    ids_ref, _, _ = decode(path, prompts, ref_path=True)
    rep["bf16_again_identical"] = same_first(ids_bf16, ids_again)
    rep["bf16_read_by_reference_identical"] = same_first(ids_bf16, ids_ref)
    pools = {"self_only": {("self", i) for i in range(num_layers)},
             "cross_only": {("cross", i) for i in range(num_layers)}}
    for pool in ("self", "cross"):
        for i in range(num_layers):
            pools[f"{pool}[{i}]_only"] = {(pool, i)}
    # against bf16 pools read by the reference (the same attention arithmetic throughout), and
    # against float32 pools: which of two runs that differ is nearer the unrounded cache
    emulated = {name: decode(path, prompts, emulate=name)[0] for name in EMULATED}
    rep["emulated_vs_bf16_read_by_reference"] = {name: same_first(ids_ref, ids) for name, ids in emulated.items()}
    rep["vs_fp32_pools"] = {name: same_first(emulated["fp32"], ids) for name, ids in emulated.items() if name != "fp32"}
    rep["vs_fp32_pools"]["bf16_pools_read_by_reference"] = same_first(emulated["fp32"], ids_ref)
    rep["fp8_in"] = {}
    for name, only in pools.items():
        ids, _, _ = decode(path, prompts, fp8=True, only=only)
        rep["fp8_in"][name] = same_first(ids_bf16, ids)
    ids_fp8, _, probe = decode(path, prompts, fp8=True, probe=ScoreProbe)
    rep["vs_fp32_pools"]["fp8_pools"] = same_first(emulated["fp32"], ids_fp8)
    rep["attention_error_per_pool"] = probe.summary()
    marg = margins(lps_bf16)
    every = [m for row in marg for m in row]
    at_flip, min_before = [], []
    for a, b, row in zip(ids_bf16, ids_fp8, marg):
        t = first_difference(a, b)
        if t is not None:
            at_flip.append(row[t])
    for row in marg:
        min_before.append(min(row))
    rep["bf16_margin_all_steps"] = quantiles(every) | {"n": len(every)}
    rep["bf16_margin_at_first_flip"] = sorted(round(m, 4) for m in at_flip)
    rep["inputs_whose_min_margin_below"] = {str(t): sum(m < t for m in min_before) for t in (0.01, 0.02, 0.05, 0.1)}
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(TEXT_FAMILIES), choices=TEXT_FAMILIES)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--checkpoints", type=pathlib.Path, help="build the checkpoints here (default: a temp dir)")
    ap.add_argument("--report-json")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)       # deterministic and fair on a shared machine
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = a.checkpoints or pathlib.Path(tmp)
        for family in a.families:
            path = build_checkpoint(family, root)
            prompts = tiny_prompts(path, a.prompts, a.seed)
            ids_bf16, lps, _ = decode(path, prompts, logprobs=2 if a.diagnose else None)
            ids_fp8, _, _ = decode(path, prompts, fp8=True)
            same = same_first(ids_bf16, ids_fp8)
            # the same comparison with both runs' attention in one arithmetic (fp32, the reference),
            # as on the GPU, where one Triton kernel reads both pool dtypes
            ids_bf16_ref, _, _ = decode(path, prompts, ref_path=True)
            same_ref = same_first(ids_bf16_ref, ids_fp8)
            row = {"inputs": len(prompts), "first16_identical": same, "first16_identical_same_attention": same_ref,
                   "first_flip_steps": str(sorted(t for t in (first_difference(x, y) for x, y in zip(ids_bf16, ids_fp8))
                                              if t is not None))}
            if a.diagnose:
                from transformers import AutoConfig

                cfg = AutoConfig.from_pretrained(path)
                layers = getattr(cfg, "num_decoder_layers", None) or getattr(cfg, "decoder_layers", None) \
                    or cfg.num_layers
                row["diagnose"] = diagnose(path, prompts, ids_bf16, lps, layers)
            report[family] = row
            print(f"{family}: first {FIRST_TOKENS} tokens identical on {same}/{len(prompts)} "
                  f"({100 * same / len(prompts):.1f}%, rule >= 95%); against bf16 KV read by the same "
                  f"attention arithmetic {same_ref}/{len(prompts)}", flush=True)
    print(json.dumps(report, indent=1))
    if a.report_json:
        pathlib.Path(a.report_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
