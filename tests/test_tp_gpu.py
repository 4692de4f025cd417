"""Tensor parallelism on two GPUs (NCCL). Run on a 2-GPU machine with `pytest -m gpu tests/test_tp_gpu.py`."""
import pytest
import torch

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

PROMPTS = [f"translate English to German: sentence number {i} " + "word " * (i % 7) for i in range(20)]
KV = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)


def _generate(path, tp: int, dtype: str, params: SamplingParams, **kw):
    with LLM(path, dtype=dtype, attn_backend="triton", max_batch_size=16, kv_cache_config=KV,
             tensor_parallel_size=tp, **kw) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        info = llm.model_info
    return [o.outputs[0].token_ids for o in outs], info


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart"])
def test_float32_tp2_greedy_identical_to_tp1(family, request):
    """Eager (float32 declines graphs), overlap scheduler on: NCCL all-reduces, token broadcast."""
    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ref, _ = _generate(path, 1, "float32", params)
    got, info = _generate(path, 2, "float32", params)
    assert info["tensor_parallel_size"] == 2 and info["overlap_scheduler"]
    assert got == ref


def test_whisper_float32_tp2_identical_to_tp1(whisper):
    """Every rank turns the raw audio into log-mel features on its own GPU."""
    import numpy as np

    waves = [(np.random.RandomState(i).randn(16000 * (3 + 9 * i)) * 0.1).astype(np.float32) for i in range(3)]
    inputs = [{"prompt": "", "multi_modal_data": {"audio": [(w, 16000)]}} for w in waves]
    got = {}
    for tp in (1, 2):
        with LLM(whisper, dtype="float32", attn_backend="triton", max_batch_size=4, kv_cache_config=KV,
                 tensor_parallel_size=tp) as llm:
            assert llm.engine.runner.log_mel is not None
            outs = llm.generate(inputs, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
        got[tp] = [o.outputs[0].token_ids for o in outs]
    assert got[2] == got[1]


@pytest.mark.parametrize("overlap", [True, False])
def test_bfloat16_tp2_cuda_graphs_match_tp2_eager(flan_t5, overlap):
    """bf16 captures decoder graphs with the all-reduces inside; replaying them gives the eager ids."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed, info = _generate(flan_t5, 2, "bfloat16", params, disable_overlap_scheduler=not overlap)
    assert info["cuda_graphs"] and info["overlap_scheduler"] == overlap
    assert all(len(ids) == 12 for ids in graphed)
    eager, info = _generate(flan_t5, 2, "bfloat16", params, disable_overlap_scheduler=not overlap,
                            cuda_graph_config=None)
    assert not info["cuda_graphs"]
    assert graphed == eager


def test_tp2_bench_with_cuda_graphs_exits_when_done(flan_t5, tmp_path):
    """A TP=2 bf16 bench (the decoder graphs capture the all-reduces) finishes and exits with
    a complete report. NCCL's abort waits for every graph that captured the communicator, so
    shutdown destroys the graphs first; before that, two flan-t5-xl runs hung after their work."""
    import json
    import signal
    import subprocess
    import sys

    report = tmp_path / "tp2.json"
    cmd = [sys.executable, "-X", "faulthandler", "-m", "enc2dec.cli.main", "bench", "--model", flan_t5,
           "--dtype", "bfloat16", "--tp-size", "2", "--input-len", "32", "--output-len", "16",
           "--concurrency", "1,4", "--num-requests", "2,8", "--warmup", "0", "--quiet", "--report-json", str(report)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)             # faulthandler prints where every thread is
        _, err = proc.communicate()
        pytest.fail(f"TP=2 bench did not exit within 240 s; its threads:\n{err[-8000:]}")
    assert proc.returncode == 0, err[-4000:]
    rep = json.loads(report.read_text())
    assert rep["complete"] and rep["engine_args"]["tensor_parallel_size"] == 2
    assert [lv["completed"] for lv in rep["levels"]] == [2, 8]
