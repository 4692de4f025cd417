"""Ray: the Serve deployment and Ray Data transcription on a local two-CPU cluster (loopback only).

One cluster for the module (started once, shut down after): the deployment answers like the
in-process engine on the tiny T5, and Ray Data on the real whisper-tiny.en gives the
single-process command's text and files."""
from __future__ import annotations

import json
import logging

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "enc2dec[ray]")')
pytest.importorskip("ray.serve", reason='Ray Serve is not installed (pip install "enc2dec[ray]")')
httpx = pytest.importorskip("httpx")

from typer.testing import CliRunner  # noqa: E402

from enc2dec.cli.main import app as cli_app  # noqa: E402
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from enc2dec.engine.launch import build_llm_args  # noqa: E402

KV = {"kv_cache_config": {"cross_kv_cache_fraction": 0.5, "tokens_per_block": 4, "max_cpu_memory_bytes": 32 << 20}}


def _logging_state() -> dict:
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return {lg: (list(lg.handlers), lg.level, lg.propagate) for lg in loggers}


@pytest.fixture(scope="module")
def cluster():
    # Ray and Ray Serve attach handlers to loggers, some bound to the stream that a CliRunner
    # test had as stderr; left in place, every later test that logs writes to a closed stream.
    before = _logging_state()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    for lg, state in _logging_state().items():
        lg.handlers[:], lg.level, lg.propagate = before.get(lg, ([], logging.NOTSET, True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_deployment_answers_like_the_engine(cluster, t5_relu):
    from ray import serve

    from enc2dec.serve.config import ServeConfig
    from enc2dec.serve.ray_serve import build_application

    port = _free_port()
    config = ServeConfig(model=t5_relu, served_model_names=("tiny-t5",))
    args = build_llm_args(t5_relu, defaults={"dtype": "float32", "max_batch_size": 8, "max_input_len": 64, **KV},
                          device="cpu")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_application(config, args), name="enc2dec", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny-t5", "prompt": "translate the house is big", "max_tokens": 12,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    bad = httpx.post(url + "/v1/completions", timeout=30, json={"model": "other", "prompt": "x"})
    serve.delete("enc2dec")
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=64,
             kv_cache_config=KvCacheConfig(**KV["kv_cache_config"])) as llm:
        ref = llm.generate("translate the house is big", SamplingParams(max_tokens=12, temperature=0)).outputs[0]
    assert r.json()["choices"][0]["text"] == ref.text
    assert bad.status_code == 404 and bad.json()["error"]["type"]      # our OpenAI-style error, not Ray's


def test_ray_data_transcription_equals_the_cli(cluster, real_whisper, tmp_path):
    clips = [str(real_whisper.manifest.parent / json.loads(line)["audio"]) for line in open(real_whisper.manifest)]
    runner = CliRunner()
    common = ["--model", str(real_whisper.tiny_en), "--quiet", "-f", "txt,json", "--device", "cpu"]
    here = runner.invoke(cli_app, ["transcribe", *clips, *common, "-o", str(tmp_path / "here")])
    assert here.exit_code == 0, here.output
    on_ray = runner.invoke(cli_app, ["transcribe", *clips, *common, "-o", str(tmp_path / "ray"),
                                     "--ray-address", "auto"])
    assert on_ray.exit_code == 0, on_ray.output
    assert "1 Ray actor(s)" in on_ray.output
    names = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ray").iterdir()) and len(names) == 2 * len(clips)
    for name in names:
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "here" / name).read_text(), name


def test_ray_data_rows_of_bytes_keep_their_names_and_report_bad_audio(cluster, real_whisper):
    import pickle

    from enc2dec.engine.whisper.ray_data import WhisperTranscriber, actor_options

    rows = [json.loads(line) for line in open(real_whisper.manifest)][:2]
    folder = real_whisper.manifest.parent
    items = [{"path": r["audio"], "bytes": (folder / r["audio"]).read_bytes()} for r in rows]
    items.append({"path": "broken.wav", "bytes": b"not audio"})
    args = build_llm_args(str(real_whisper.tiny_en), device="cpu")
    out = ray.data.from_items(items).map_batches(WhisperTranscriber, **actor_options(args, rows_per_batch=8))
    got = {row["source"]: row for row in out.iter_rows()}
    assert set(got) == {r["audio"] for r in rows} | {"broken.wav"}
    assert "broken.wav" in got["broken.wav"]["error"] and got["broken.wav"]["text"] == ""
    for r in rows:
        t = pickle.loads(got[r["audio"]]["transcript"])
        assert t.error is None and t.text == got[r["audio"]]["text"] and len(t.text.split()) > 3


def test_ray_data_text_rows_get_the_engine_greedy_generation(cluster, t5_relu):
    from enc2dec.engine.whisper.ray_data import TextGenerator, actor_options

    prompts = ["translate the house is big", "summarize: a cat sat", "stream me some words"]
    args = build_llm_args(t5_relu, defaults={"dtype": "float32", "max_batch_size": 8, "max_input_len": 64, **KV},
                          device="cpu")
    out = ray.data.from_items([{"prompt": p, "id": i} for i, p in enumerate(prompts)]).map_batches(
        TextGenerator, **actor_options(args, {"sampling": {"max_tokens": 10}}, rows_per_batch=2))
    got = {row["id"]: row for row in out.iter_rows()}
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=64,
             kv_cache_config=KvCacheConfig(**KV["kv_cache_config"])) as llm:
        ref = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert [got[i]["generation"] for i in range(3)] == [r.outputs[0].text for r in ref]
    assert [got[i]["prompt"] for i in range(3)] == prompts         # the input columns pass through


def test_serve_ray_autoscaling_must_be_a_json_object():
    r = CliRunner().invoke(cli_app, ["serve", "x", "--ray-address", "local", "--ray-autoscaling", "[1, 2]"])
    assert r.exit_code == 2 and "--ray-autoscaling must be a JSON object" in r.output


def test_an_engine_asks_ray_for_its_tensor_parallel_gpus_and_none_on_the_cpu(cluster):
    from dataclasses import replace

    from enc2dec.engine.ray_cluster import gpus_per_engine

    args = build_llm_args("m", device="cuda", tensor_parallel_size=2)
    assert gpus_per_engine(args) == 2
    assert gpus_per_engine(replace(args, device="cpu")) == 0
    assert gpus_per_engine(replace(args, device="auto")) == 0          # the 2-CPU test cluster has no GPU
