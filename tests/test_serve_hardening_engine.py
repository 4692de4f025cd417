"""One poisoned request among running ones, through the engine's own API: refused alone at
submit (ValueError), before it can join a batch, while its neighbours finish unchanged."""
from __future__ import annotations

import asyncio

import pytest

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams

KV = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_cpu_memory_bytes=32 << 20)
POISON = [
    dict(max_tokens=8, min_tokens=4, stop_token_ids=[99999999]),
    dict(temperature=1.0, top_k=10**20),
    dict(temperature=float("inf")),
    dict(max_tokens=True),
    dict(end_id=-1),
]


@pytest.fixture(scope="module")
def llm(t5_relu):
    engine = LLM(t5_relu, dtype="float32", max_batch_size=16, max_input_len=64, kv_cache_config=KV)
    yield engine
    engine.shutdown()


def test_a_poisoned_request_is_refused_alone_and_neighbours_finish(llm):
    good = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, i + 1] for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, good, use_tqdm=False)]

    async def run():
        handles = [llm.generate_async(p, good, streaming=True) for p in prompts]
        refused = []
        for kw in POISON:
            try:
                llm.generate_async([5, 6, 1], SamplingParams(**kw))
            except ValueError as e:
                refused.append(str(e))
        outs = [await h for h in handles]
        return refused, outs

    refused, outs = asyncio.run(run())
    assert len(refused) == len(POISON), refused
    assert "outside the vocabulary" in refused[0] and "top_k" in refused[1] and "temperature" in refused[2]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.error is None for o in outs)
    assert llm.is_healthy
