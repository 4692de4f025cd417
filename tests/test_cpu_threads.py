"""OpenMP pools on the CPU (engine/runner/cpu_threads.py): the runner builds its model on a
short-lived thread, and what the build returns or raises must reach the caller unchanged; a
caller that blocks on a CPU engine gives up its own pool."""
import os
import sys
import threading
import time

import pytest
import torch

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.runner.cpu_threads import on_fresh_thread, release_thread_pool


def test_returns_the_result_computed_on_another_thread():
    caller = threading.get_ident()
    result = on_fresh_thread(lambda: ("built", threading.get_ident()))
    assert result[0] == "built" and result[1] != caller


def test_a_load_error_reaches_the_caller_with_its_type_and_message():
    def bad_load():
        raise ValueError("load_format='bogus' is not supported")

    with pytest.raises(ValueError, match="load_format='bogus'"):
        on_fresh_thread(bad_load)


# ---- the caller's OpenMP pool (release_thread_pool) -------------------------------------------
needs_pools = pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.get_num_threads() < 2,
    reason="counts OpenMP worker threads through /proc on a machine where torch runs ops on 2+ threads")


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _exited(workers: set[int], timeout_s: float = 5.0) -> bool:
    """Whether every thread of ``workers`` has left the process. libgomp's pause tells a pool's
    workers to exit and returns without joining them (they are detached), so on a busy machine one
    can still be listed for a moment; a pool that was not freed stays listed for good."""
    deadline = time.monotonic() + timeout_s
    while workers & _threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _pool_of_this_thread() -> set[int]:
    """Run one parallel op here and return the worker threads it left behind (this thread's pool)."""
    release_thread_pool()                    # start from no pool, whatever earlier tests ran here
    before = _threads()
    torch.randn(1 << 22).exp_().sum()        # far above torch's grain: runs on every thread
    workers = _threads() - before
    assert workers, "the op ran on one thread: this test would prove nothing"
    return workers


@needs_pools
def test_release_frees_the_calling_threads_workers_and_torch_works_after():
    workers = _pool_of_this_thread()
    release_thread_pool()
    assert _exited(workers)
    x = torch.arange(1 << 22, dtype=torch.float64)
    assert x.sum().item() == (1 << 22) * ((1 << 22) - 1) / 2     # a new pool, right answers
    release_thread_pool()
    release_thread_pool()                    # nothing to free: a no-op


@needs_pools
def test_release_finds_torchs_libgomp_when_another_wheels_copy_was_loaded_first():
    # sentencepiece (the T5 tokenizers) ships its own libgomp; pausing that one frees nothing of torch's
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceProcessor()
    from enc2dec.engine.runner import cpu_threads

    cpu_threads._find_pause.cache_clear()                     # look the runtime up again, now
    workers = _pool_of_this_thread()
    release_thread_pool()
    assert _exited(workers)


@needs_pools
def test_a_caller_that_blocks_on_the_cpu_engine_gives_up_its_pool_one_that_goes_on_keeps_it(t5_relu):
    # Its pool would throttle the engine thread's (libgomp spins no more once the process holds
    # more workers than cores): measured, a flan-t5-small step 16.4 ms against 9.9 ms.
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(t5_relu, dtype="float32", device="cpu", max_batch_size=4, max_input_len=32,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        workers = _pool_of_this_thread()
        handle = llm.generate_async([5, 6, 7], params)
        assert workers <= _threads()         # generate_async returns at once: the caller works on
        assert handle.result().outputs[0].token_ids
        assert _exited(workers)      # result() blocks: the pool is gone

        workers = _pool_of_this_thread()
        assert llm.generate([5, 6, 7], params).outputs[0].token_ids
        assert _exited(workers)
