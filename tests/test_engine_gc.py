"""The engine and Python's garbage collector."""
import gc

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams


def test_a_running_engine_keeps_its_heap_out_of_full_collections_and_shutdown_hands_it_back(t5_relu):
    """A full collection over a loaded engine's objects is a ~100 ms stall of the step loop: they
    are frozen while it runs, and returned to the collector (so nothing stays pinned) after."""
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, max_tokens=4096)
    with LLM(t5_relu, dtype="float32", max_batch_size=4, max_input_len=32, kv_cache_config=kv) as llm:
        assert gc.get_freeze_count() > 10_000           # torch, transformers and the model
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    assert gc.get_freeze_count() == 0
