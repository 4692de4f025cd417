"""Several API processes over one engine process: ``ProcessLLM(listen=True)`` and
``ProcessLLM.attach``. Each client gets its own requests' outputs, the same as the engine's
own client would; a client that leaves has its requests aborted and leaves the engine up."""
from __future__ import annotations

import multiprocessing
import time

import pytest
from test_engine_process import OPTIONS, PROMPTS

from enc2dec.engine import LLM, SamplingParams
from enc2dec.engine.config import LlmArgs
from enc2dec.engine.engine_process import EngineProcessError, ProcessLLM


@pytest.fixture(scope="module")
def served(t5_relu):
    owner = ProcessLLM(LlmArgs.from_dict(OPTIONS, model=t5_relu), listen=True)
    try:
        yield owner
    finally:
        owner.shutdown()


def _ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _attached_generate(address, prompts, max_tokens, queue) -> None:
    """In another process, as an API worker would: attach, generate, detach."""
    client = ProcessLLM.attach(address)
    try:
        outs = client.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
        queue.put([[c.token_ids for c in o.outputs] for o in outs])
    finally:
        client.shutdown()


def test_clients_in_other_processes_get_their_own_outputs_beside_the_owners(served, t5_relu):
    with LLM(t5_relu, **OPTIONS) as local:
        want = _ids(local.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    # Two attached processes and the owner decode at the same time, different prompts each.
    procs = [ctx.Process(target=_attached_generate, args=(served.attach_address, [p], 12, queue))
             for p in PROMPTS[1:]]
    for p in procs:
        p.start()
    mine = served.generate([PROMPTS[0]] * 3, SamplingParams(max_tokens=12), use_tqdm=False)
    theirs = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert _ids(mine) == [want[0]] * 3
    assert theirs == sorted([[want[1]], [want[2]]])
    assert served.is_healthy              # the attached clients detached; the engine serves on
    assert served.generate(PROMPTS[1], SamplingParams(max_tokens=12)).outputs[0].token_ids == want[1][0]


def test_an_attached_client_that_leaves_mid_request_has_its_request_aborted(served):
    client = ProcessLLM.attach(served.attach_address)
    handle = client.generate_async(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True), streaming=True)
    next(iter(handle))                    # decoding
    assert served.stats()["running"] >= 1 or client.stats()["running"] >= 1
    client._conn.close()                  # as if its process died: no detach message
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # The owner's counters come with its own outputs: give it one step to read them.
        served.generate(PROMPTS[1], SamplingParams(max_tokens=2))
        if served.stats()["running"] == 0:
            break
    assert served.stats()["running"] == 0 and served.stats()["waiting"] == 0
    assert served.is_healthy


def test_shutting_down_an_attached_client_fails_only_its_requests(served):
    client = ProcessLLM.attach(served.attach_address)
    assert client.pid == served.pid and client.tokenizer is not None
    client.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        client.generate_async(PROMPTS[0])
    assert served.generate(PROMPTS[0], SamplingParams(max_tokens=3)).outputs[0].token_ids


def test_a_wrong_key_is_refused_and_the_engine_keeps_listening(served):
    path, key = served.attach_address
    with pytest.raises(EngineProcessError, match="refused"):
        ProcessLLM.attach((path, bytes(32)))
    client = ProcessLLM.attach((path, key))
    try:
        assert client.generate(PROMPTS[0], SamplingParams(max_tokens=3)).outputs[0].token_ids
    finally:
        client.shutdown()


def test_attached_clients_see_the_engine_stop_with_its_owner(t5_relu):
    owner = ProcessLLM(LlmArgs.from_dict(OPTIONS, model=t5_relu), listen=True)
    client = ProcessLLM.attach(owner.attach_address)
    handle = client.generate_async(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True), streaming=True)
    next(iter(handle))
    owner.shutdown()
    final = handle.result(timeout=30)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    deadline = time.monotonic() + 10
    while client.is_healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client.is_healthy
    client.shutdown()
