"""The sampler's cost per step for Whisper rows, plain (suppress masks) and with the timestamp
rules, on the CPU under cProfile: what a step's token choice costs the host beyond its kernels.

    python bench/scripts/sampler_host.py --rows 64

Each step gets a new batch (its rows rotated), as a Whisper step that admits a clip does, so
whatever the sampler stages once per batch composition is paid every step. On the CPU the
figure includes the ops' compute; the cProfile table separates Python from the torch calls.
A lab script (dummy whisper-tiny, no GPU), not a benchmark.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from enc2dec.engine import LLM, KvCacheConfig, LlmArgs
from enc2dec.engine.runner.sampler import Sampler, SeqSamplingState
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.whisper.tokens import MAX_INITIAL_TIMESTAMP_INDEX, decoding_rules, engine_whisper_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM.from_args(LlmArgs.from_dict({}, model="openai/whisper-tiny", load_format="dummy", dtype="float32",
                                          kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)))
    tokens, _, _ = engine_whisper_info(llm)
    proc, vocab = llm.engine.processor, llm.engine.hf_config.vocab_size
    for timestamps in (False, True):
        rules, _ = decoding_rules(tokens, detect_language=False, timestamps=timestamps, task="transcribe",
                                  max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX)
        params = SamplingParams(max_tokens=96, ignore_eos=True, temperature=0.0, logits_processors=rules or None)
        states = [SeqSamplingState(params, (tokens.eot,), (), proc.suppress_token_ids, proc.begin_suppress_token_ids)
                  for _ in range(a.rows)]
        sampler, logits, seq_ids = Sampler(), torch.randn(a.rows, vocab), list(range(a.rows))

        def step(k: int):
            rotated = states[k % a.rows:] + states[:k % a.rows]
            return sampler.sample(logits, rotated, [5 + k] * a.rows, seq_ids=seq_ids)

        for k in range(5):
            step(k)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for k in range(a.steps):
            step(k)
        prof.disable()
        ms = (time.perf_counter() - t0) * 1e3 / a.steps
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
        print(f"timestamps={timestamps}: {ms:.2f} ms a step under cProfile ({a.rows} rows, CPU, compute included)")
        print(out.getvalue())
    llm.shutdown()


if __name__ == "__main__":
    main()
