"""/v1/audio/transcriptions and /translations through the openai client and httpx: every
response_format, streaming, long audio, bad uploads; the tiny random Whisper always, the
real Whisper tiny.en (`real` mark) for text that must be right."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from enc2dec.engine import KvCacheConfig
from test_serve_helpers import LiveServer, ServeConfig, httpx, tiny_llm_factory, tone, wav_bytes

openai = pytest.importorskip("openai")
pytest.importorskip("soundfile")

NAME = "whisper-1"


@pytest.fixture(scope="module")
def tiny(whisper):
    cfg = ServeConfig(model=whisper, served_model_names=(NAME,), max_upload_bytes=1_500_000, max_audio_s=40.0)
    srv = LiveServer(cfg, tiny_llm_factory(whisper, max_input_len=1500, max_num_tokens=4096,
                                           max_batch_size=8)).start()
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


FORCE = {"max_tokens": 6, "ignore_eos": True}     # random weights: force some text out (needs a language)


@pytest.mark.parametrize("fmt", ["json", "text", "srt", "vtt", "verbose_json"])
def test_every_response_format(tiny, fmt):
    r = _client(tiny).audio.transcriptions.create(model=NAME, file=("a.wav", wav_bytes(tone(2.5))),
                                                  language="en", response_format=fmt, extra_body=FORCE)
    if fmt == "json":
        assert isinstance(r.text, str) and r.text
        assert r.usage.output_tokens == 6 and r.usage.input_tokens == 125          # 50 positions a second
    elif fmt == "text":
        assert isinstance(r, str) and r.strip()
    elif fmt == "srt":
        assert re.match(r"1\n00:00:00,000 --> 00:00:02,500\n.+\n\n$", r), r
    elif fmt == "vtt":
        assert re.match(r"WEBVTT\n\n00:00:00\.000 --> 00:00:02\.500\n.+\n\n$", r), r
    else:
        assert r.duration == pytest.approx(2.5) and r.language == "english" and r.text
        assert r.segments[0].start == 0 and r.segments[0].end == pytest.approx(2.5)


def test_streaming_events_end_with_done_and_usage(tiny):
    events = list(_client(tiny).audio.transcriptions.create(
        model=NAME, file=("a.wav", wav_bytes(tone(1.0))), language="en", stream=True, extra_body=FORCE))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and "".join(deltas) == done.text and done.usage.output_tokens == 6


def test_resampled_stereo_upload_and_a_verbatim_decoder_prefix(tiny):
    pytest.importorskip("soxr")
    wave8k = tone(2.0, rate=8000)
    plain = httpx.post(tiny.url + "/v1/audio/transcriptions", files={"file": ("s.wav", wav_bytes(wave8k, 8000, 2))},
                       data={"model": NAME, "language": "en", **FORCE}, timeout=60)
    assert plain.status_code == 200 and plain.json()["usage"]["output_tokens"] == 6
    prefixed = httpx.post(tiny.url + "/v1/audio/transcriptions", files={"file": ("a.wav", wav_bytes(tone(1.0)))},
                          data={"model": NAME, "prompt": "<|startoftranscript|>", **FORCE}, timeout=60)
    assert prefixed.status_code == 200, prefixed.text


def test_long_audio_is_decoded_in_windows(tiny):
    r = httpx.post(tiny.url + "/v1/audio/transcriptions", files={"file": ("long.wav", wav_bytes(tone(35.0)))},
                   data={"model": NAME}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == 1750
    m = tiny.wait_idle()
    assert m['enc2dec_kv_blocks_used{pool="cross"}'] == 0 and m["enc2dec_num_requests_in_flight"] == 0


def test_without_silero_vad_long_uploads_get_a_500_that_names_the_fix(tiny, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "silero_vad"
                        else real_find_spec(name, *a))
    assert tiny.config.long_form_strategy == "vad"          # the default
    r = httpx.post(tiny.url + "/v1/audio/transcriptions", files={"file": ("long.wav", wav_bytes(tone(35.0)))},
                   data={"model": NAME}, timeout=120)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "vad_unavailable" and 'pip install "enc2dec[audio]"' in err["message"]
    assert "--long-form-strategy chunked" in err["message"]
    # A clip of at most 30 s is one window, no VAD: it still works on the same server.
    r = httpx.post(tiny.url + "/v1/audio/transcriptions", files={"file": ("a.wav", wav_bytes(tone(2.5)))},
                   data={"model": NAME, "response_format": "verbose_json"}, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("data, files, status, needle", [
    ({"model": NAME}, {"file": ("x.wav", b"this is not audio")}, 400, "cannot decode"),
    ({"model": NAME}, {"file": ("x.wav", b"")}, 400, "empty"),
    ({"model": NAME}, None, 400, "'file' is a required field"),
    ({"model": "gpt-4o-transcribe"}, "tone", 404, "does not exist"),
    ({"model": NAME, "response_format": "docx"}, "tone", 400, "response_format"),
    ({"model": NAME, "temperature": "hot"}, "tone", 400, "temperature"),
    ({"model": NAME, "colour": "red"}, "tone", 400, "Unrecognized request argument supplied: colour"),
    ({"model": NAME, "language": "de"}, "tone", 400, "not one this checkpoint knows"),
    ({"model": NAME, "language": "klingon"}, "tone", 400, "klingon"),
    ({"model": NAME, "temperature": "1.5"}, "tone", 400, "temperature"),
    ({"model": NAME, "prompt": "<|startoftranscript|>"}, "long", 400, "at most 40 s"),
    ({"model": NAME, "stream": "true", "response_format": "srt"}, "tone", 400, "stream=true"),
    ({"model": NAME}, "long", 400, "at most 40 s"),
    ({"model": NAME}, "huge", 413, "too large"),
])
def test_bad_uploads_get_openai_errors(tiny, data, files, status, needle):
    clips = {"tone": tone(1.0), "long": tone(45.0), "huge": tone(60.0)}
    if isinstance(files, str):
        files = {"file": ("a.wav", wav_bytes(clips[files]))}
    r = httpx.post(tiny.url + "/v1/audio/transcriptions", data=data, files=files, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")      # the openai client deprecates translations
def test_translation_detects_the_language_and_text_prompts_are_refused(tiny):
    r = _client(tiny).audio.translations.create(model=NAME, file=("a.wav", wav_bytes(tone(1.0))),
                                                response_format="verbose_json")
    assert r.language in ("english", "french") and r.duration == pytest.approx(1.0)
    with pytest.raises(openai.BadRequestError, match="language"):
        _client(tiny).audio.translations.create(model=NAME, file=("a.wav", wav_bytes(tone(1.0))),
                                                extra_body={"language": "en"})
    r = httpx.post(tiny.url + "/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and "/v1/audio/transcriptions" in r.json()["error"]["message"]


def test_bench_url_audio(tiny, tmp_path):
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    report = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", "--quiet", "--url", tiny.url, "--audio-seconds", "2", "--output-len", "4",
                                 "--concurrency", "2", "--num-requests", "2", "--warmup", "0", "--streaming",
                                 "--report-json", str(report)])
    assert r.exit_code == 0, r.output
    (level,) = json.loads(report.read_text())["levels"]
    assert level["completed"] == 2 and level["output_tokens"] == 8
    assert 0 < level["p50_ttft_ms"] <= level["p50_e2e_ms"] and level["mean_itl_ms"] > 0


# ---- real Whisper tiny.en ---------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def _wer(ref: str, hyp: str) -> float:
    r, h = _words(ref), _words(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[len(h)] / max(1, len(r))


@pytest.fixture(scope="module")
def real(real_whisper):
    cfg = ServeConfig(model=str(real_whisper.tiny_en), served_model_names=(NAME,))
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, max_cpu_memory_bytes=256 << 20)     # 1500 positions each
    srv = LiveServer(cfg, tiny_llm_factory(str(real_whisper.tiny_en), max_input_len=1500, max_num_tokens=4096,
                                           max_batch_size=8, kv_cache_config=kv)).start()
    rows = [json.loads(line) for line in real_whisper.manifest.read_text().splitlines() if line.strip()]
    clips = [(real_whisper.manifest.parent / row["audio"], row["text"]) for row in rows]
    yield srv, clips
    srv.stop()


@pytest.mark.real
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_real_whisper_every_format_transcribes_correctly(real):
    srv, clips = real
    client = _client(srv)
    path, ref = clips[0]
    audio = path.read_bytes()
    plain = client.audio.transcriptions.create(model=NAME, file=(path.name, audio))
    assert _wer(ref, plain.text) < 0.15, (plain.text, ref)
    text = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), response_format="text")
    assert text.strip() == plain.text
    verbose = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), response_format="verbose_json")
    assert verbose.language == "english" and _wer(ref, verbose.text) < 0.15
    ends = [(s.start, s.end) for s in verbose.segments]
    assert ends and all(0 <= a < b <= verbose.duration + 0.02 for a, b in ends)
    assert all(ends[i][1] <= ends[i + 1][0] + 1e-6 for i in range(len(ends) - 1))
    srt = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), response_format="srt")
    assert srt.startswith("1\n00:00:0") and len(srt.strip().split("\n\n")) == len(verbose.segments)
    vtt = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:0") and _wer(ref, " ".join(vtt.split("\n")[3::3])) < 0.15
    events = list(client.audio.transcriptions.create(model=NAME, file=(path.name, audio), stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == plain.text
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.translations.create(model=NAME, file=(path.name, audio))
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.transcriptions.create(model=NAME, file=(path.name, audio), language="de")


@pytest.mark.real
def test_real_whisper_long_audio_and_concurrent_clips(real):
    import asyncio

    import soundfile

    srv, clips = real
    waves = [soundfile.read(str(p), dtype="float32")[0] for p, _ in clips]
    long_wave = np.concatenate([np.concatenate([w, np.zeros(8000, np.float32)]) for w in waves])
    assert len(long_wave) / 16000 > 30
    r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": ("long.wav", wav_bytes(long_wave))},
                   data={"model": NAME, "response_format": "verbose_json"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert _wer(" ".join(t for _, t in clips), body["text"]) < 0.25, body["text"]
    # the last clip (27.2-30.0 s) as the last segment
    assert "go forward" in body["text"].lower() and body["segments"][-1]["start"] > 26.5

    async def all_clips():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(client.audio.transcriptions.create(model=NAME, file=(p.name, p.read_bytes()))
                                      for p, _ in clips[:3]))

    results = asyncio.run(all_clips())
    for (path, ref), res in zip(clips[:3], results):
        assert _wer(ref, res.text) < 0.3, (path.name, res.text, ref)


@pytest.mark.real
def test_real_whisper_prompt_is_previous_text_and_segments_carry_the_decode_measures(real):
    srv, clips = real
    client = _client(srv)
    path, _ = clips[0]          # "and mister john dashwood had then leisure ..."
    audio = path.read_bytes()
    plain = client.audio.transcriptions.create(model=NAME, file=(path.name, audio))
    # As faster-whisper's initial_prompt does with tiny.en: the prompt's spelling of the name wins.
    prompted = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), prompt="John Dashwode.")
    assert "Dashwood" in plain.text and "Dashwode" in prompted.text and "John Dashwode." not in prompted.text[:14]
    verbose = client.audio.transcriptions.create(model=NAME, file=(path.name, audio), response_format="verbose_json",
                                                 temperature=0.0)
    segments = verbose.segments
    assert segments and all(0 < s.no_speech_prob < 0.1 and -1.0 < s.avg_logprob < 0 and s.temperature == 0.0
                            and s.compression_ratio > 1 for s in segments)
    quiet = wav_bytes(np.zeros(3 * 16000, np.float32))
    silence = client.audio.transcriptions.create(model=NAME, file=("s.wav", quiet), response_format="verbose_json")
    assert silence.segments and all(s.no_speech_prob > 0.6 for s in silence.segments)


@pytest.mark.real
def test_real_whisper_vad_on_the_server_gives_the_library_text(real, real_tiny_llm):
    import io

    import soundfile

    from enc2dec.engine.whisper.transcribe import transcribe
    from enc2dec.serve.audio import fallback_temperatures

    srv, clips = real
    assert srv.config.long_form_strategy == "vad"
    waves = [soundfile.read(str(p), dtype="float32")[0] for p, _ in clips[:3]]
    gap = [np.zeros(s * 16000, np.float32) for s in (6, 12, 9)]
    upload = wav_bytes(np.concatenate([gap[0], waves[0], gap[1], waves[1], gap[2], waves[2], gap[0]]))
    r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": ("gaps.wav", upload)},
                   data={"model": NAME, "response_format": "verbose_json"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["duration"] > 30
    # The library on the same 16-bit samples, with the server's temperature fallback.
    samples, rate = soundfile.read(io.BytesIO(upload), dtype="float32")
    t, = transcribe(real_tiny_llm, [(samples, rate)], strategy="vad", timestamps=True,
                    temperature=fallback_temperatures(0.0))
    assert t.error is None and t.text and body["text"] == t.text
    assert [x for s in body["segments"] for x in (s["start"], s["end"])] == pytest.approx(
        [x for s in t.segments for x in (s.start_s, s.end_s)], abs=0.01)
    assert body["segments"][0]["start"] >= 5.0           # the leading silence is not decoded
