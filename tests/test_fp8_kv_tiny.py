"""FP8 KV against bf16 KV on the tiny text checkpoints, end to end on the CPU (issue 19's rule:
the first 16 greedy tokens identical on at least 95% of inputs), and what the T5 ones show.

``bench/scripts/fp8_kv_tiny.py`` measures the same over every tiny text checkpoint, with the
diagnosis; these tests keep the two facts it rests on.
"""
import random

import pytest

from enc2dec.engine import LLM, SamplingParams

FIRST_TOKENS = 16


def _prompts(path: str, n: int, seed: int = 0) -> list[dict]:
    # random token ids (not text: the tiny tokenizers retrain at every build, with last-bit
    # differences in their scores that can change how a text splits)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    special = set(tok.all_special_ids)
    pool = [i for i in range(len(tok)) if i not in special]
    empty = list(tok("")["input_ids"])
    head, tail = (empty[:1], empty[1:]) if len(empty) == 2 else ([], empty)
    rng = random.Random(seed)
    return [{"prompt_token_ids": head + [rng.choice(pool) for _ in range(rng.randint(3, 24))] + tail}
            for _ in range(n)]


def _greedy(path: str, prompts, kv_dtype: str, logprobs=None):
    with LLM(path, dtype="bfloat16", device="cpu", max_batch_size=64,
             kv_cache_config={"dtype": kv_dtype, "cross_kv_cache_fraction": 0.5}) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=FIRST_TOKENS, temperature=0.0, ignore_eos=True,
                                                    logprobs=logprobs), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]


def test_fp8_kv_keeps_the_first_16_tokens_where_the_logits_are_apart(mbart):
    # tiny mBART's bf16 top-1 / top-2 log-probability margins are above 0.6 at 99% of steps:
    # there FP8's rounding (about 1-2% of an attention output) must not change a token
    prompts = _prompts(mbart, 40)
    bf16, lps = _greedy(mbart, prompts, "auto", logprobs=2)
    fp8, _ = _greedy(mbart, prompts, "fp8")
    margins = sorted(a - b for steps in lps for d in steps for a, b in [sorted(d.values(), reverse=True)[:2]])
    assert margins[len(margins) // 100] > 0.3, margins[:10]
    same = sum(a == b for a, b in zip(bf16, fp8))
    assert same >= 0.95 * len(prompts), f"{same}/{len(prompts)}"


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "byt5"])
def test_fp8_flips_on_tiny_t5_come_at_near_ties_of_the_bf16_run(family, request):
    # The rule fails on the tiny T5s (50-80% identical): every input FP8 changes first differs
    # at a step where the bf16 run's two best tokens were within a few bf16 steps of a logit
    # (bf16 spaces logits of size 1-4 by 1/128-1/32; 1% of these runs' steps are exact ties).
    # An FP8 error that moved clear winners would show here.
    path = request.getfixturevalue(family)
    prompts = _prompts(path, 40)
    bf16, lps = _greedy(path, prompts, "auto", logprobs=2)
    fp8, _ = _greedy(path, prompts, "fp8")
    for a, b, steps in zip(bf16, fp8, lps):
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is not None:
            top = sorted(steps[t].values(), reverse=True)
            assert top[0] - top[1] < 0.05, (t, top)
