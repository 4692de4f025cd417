"""Seeded sampling through the engine: a request's tokens depend on its seed alone, not on
the run, its neighbours in the batch, or the row it lands on."""
import pytest

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams

KV = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_cpu_memory_bytes=32 << 20)
PROMPT = "a seeded prompt"


@pytest.fixture(scope="module")
def llm(t5_relu):
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=64, kv_cache_config=KV) as llm:
        yield llm


def test_seeded_request_is_the_same_alone_in_any_batch_and_as_first_of_n(llm):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=2024,
                            ignore_eos=True)
    alone = llm.generate(PROMPT, params).outputs[0].token_ids
    assert llm.generate(PROMPT, params).outputs[0].token_ids == alone
    neighbours = [("first", SamplingParams(max_tokens=6, temperature=1.0)),
                  ("second prompt", SamplingParams(max_tokens=8, temperature=0.0)),
                  ("third", SamplingParams(max_tokens=8, temperature=1.2, seed=5, n=2))]
    for row in (0, 2, 3):
        batch = neighbours[:row] + [(PROMPT, params)] + neighbours[row:]
        outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        assert outs[row].outputs[0].token_ids == alone, f"row {row}"
    # n samples: the first draws from the n=1 stream, the others from their own
    two = llm.generate(PROMPT, SamplingParams(**{**vars(params), "n": 2})).outputs
    assert two[0].token_ids == alone and two[1].token_ids != alone
    other = llm.generate(PROMPT, SamplingParams(**{**vars(params), "seed": 2025})).outputs[0].token_ids
    assert other != alone
