"""FP8 KV against bf16 KV on a real Whisper checkpoint (issue 19's accuracy rule), on a GPU.

The same checkpoint (bf16 weights) decodes the same inputs twice, once with each KV dtype,
greedy: WER of each against the references (Whisper's English normaliser, as `enc2dec eval`
scores), and the share of inputs whose first 16 tokens are identical. The inputs are the
LibriVox clips plus shifted copies of them (each clip started 0.25-1.5 s later, and pairs of
clips joined), so the identity rule is read over more than a handful of inputs; the shifted
and joined ones have no single reference, so WER is read on the whole clips only.

    python bench/scripts/fp8_kv_accuracy.py --model PATH/whisper-base --speech-dir PATH/speech
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

SHIFTS_S = (0.25, 0.5, 0.75, 1.0, 1.5)
FIRST_TOKENS = 16


def load_inputs(speech_dir: pathlib.Path):
    import soundfile as sf

    rows = [json.loads(line) for line in (speech_dir / "manifest.jsonl").read_text().splitlines() if line.strip()]
    clips = []
    for row in rows:
        wave, rate = sf.read(speech_dir / row["audio"], dtype="float32")
        if rate != 16000:
            import soxr

            wave = soxr.resample(wave, rate, 16000).astype(np.float32)
        if wave.ndim > 1:
            wave = wave.mean(axis=1)
        if len(wave) <= 30 * 16000:
            clips.append((row["text"], wave))
    inputs = [(ref, w) for ref, w in clips]
    inputs += [(None, w[int(s * 16000):]) for _, w in clips for s in SHIFTS_S]
    inputs += [(None, np.concatenate([a, b])[:30 * 16000]) for (_, a), (_, b) in zip(clips, clips[1:] + clips[:1])]
    return inputs


def decode(model: str, dtype: str, kv_dtype: str, inputs, max_tokens: int):
    """Token ids and texts of every input, and the tokenizer."""
    from enc2dec.engine import LLM, SamplingParams

    with LLM(model, dtype=dtype, max_batch_size=64,
             kv_cache_config={"dtype": kv_dtype, "cross_kv_cache_fraction": 0.5,
                              "free_gpu_memory_fraction": 0.3}) as llm:
        prompts = [{"prompt": "", "multi_modal_data": {"audio": [(w, 16000)]}} for _, w in inputs]
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
        tokenizer = llm.tokenizer
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--speech-dir", required=True, type=pathlib.Path)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16", help="weights (bfloat16 on the GPU: the rule's setting)")
    ap.add_argument("--report-json")
    a = ap.parse_args()

    from enc2dec.eval.metrics import wer_cer, whisper_normalizer

    inputs = load_inputs(a.speech_dir)
    ids_bf16, text_bf16, tok = decode(a.model, a.dtype, "auto", inputs, a.max_tokens)
    ids_fp8, text_fp8, _ = decode(a.model, a.dtype, "fp8", inputs, a.max_tokens)
    norm = whisper_normalizer(a.model, tok, "en")
    whole = [i for i, (ref, _) in enumerate(inputs) if ref is not None]
    refs = [norm(inputs[i][0]) for i in whole]
    wer_bf16 = wer_cer([norm(text_bf16[i]) for i in whole], refs)
    wer_fp8 = wer_cer([norm(text_fp8[i]) for i in whole], refs)
    same16 = sum(a_[:FIRST_TOKENS] == b_[:FIRST_TOKENS] for a_, b_ in zip(ids_bf16, ids_fp8))
    same_all = sum(a_ == b_ for a_, b_ in zip(ids_bf16, ids_fp8))
    report = {"model": a.model, "inputs": len(inputs), "whole_clips": len(whole),
              "wer_bf16_kv": wer_bf16, "wer_fp8_kv": wer_fp8,
              "first16_identical": same16, "all_tokens_identical": same_all,
              "differing": [{"input": i, "bf16": text_bf16[i], "fp8": text_fp8[i]}
                            for i in range(len(inputs)) if ids_bf16[i] != ids_fp8[i]][:10]}
    print(json.dumps(report, indent=1))
    print(f"\nfp8 KV vs bf16 KV on {a.model}: WER {100 * wer_fp8['wer']:.2f}% vs {100 * wer_bf16['wer']:.2f}% over {len(whole)} clips; "
          f"first {FIRST_TOKENS} tokens identical on {same16}/{len(inputs)} inputs "
          f"({100 * same16 / len(inputs):.1f}%, rule >= 95%); all tokens on {same_all}/{len(inputs)}")
    if a.report_json:
        pathlib.Path(a.report_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
