"""Shared fixtures: tiny random checkpoints of every family (built once per session) and
the real Whisper checkpoints from ../shared/tools/real_models.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# `python -m pytest` (the README's command) puts the working directory, the repository root,
# first on sys.path. There kernels/ (installed as enc2dec.kernels) shadows the `kernels`
# distribution that transformers 5.25 depends on and imports with its activations, so every
# model import failed with "cannot import name 'CUDAProperties' from 'kernels'". This tree's
# folders are imported only as enc2dec.* (the editable install's mapping), never from the root.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import torch  # noqa: E402

# Without a GPU, Triton kernels run in its CPU interpreter; the mode is read when triton is
# first imported (torch and transformers may import it early), so set it before anything runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny_models  # noqa: E402
from fake_engine import FakeLLM  # noqa: E402

# No model hub here or in CI: fail fast instead of waiting on network timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
REAL_MODELS_SCRIPT = REPO.parent / "shared" / "tools" / "real_models.py"


def _tiny(name: str):
    @pytest.fixture(scope="session", name=name)
    def fixture(tmp_path_factory) -> str:
        return tiny_models.build(name, str(tmp_path_factory.mktemp(name)))
    fixture.__doc__ = f"Folder of a tiny random {name} checkpoint with its tokenizer."
    return fixture


t5_relu = _tiny("t5_relu")
flan_t5 = _tiny("flan_t5")
byt5 = _tiny("byt5")
bart = _tiny("bart")
mbart = _tiny("mbart")
whisper = _tiny("whisper")
whisper_ts = _tiny("whisper_ts")


@pytest.fixture
def fake_llm(monkeypatch):
    """The engines bench starts, each a FakeLLM (no model, 1 ms steps)."""
    made = []

    def start(args):
        made.append(FakeLLM(args))
        return made[-1]

    monkeypatch.setattr("enc2dec.bench.runner.start_llm", start)
    return made


REAL_ARTIFACTS = {"tiny_en": "whisper-tiny.en", "base": "whisper-base", "speech": "speech"}


class RealWhisper:
    """Paths of the real artifacts; touching one that could not be had skips that test."""

    def __init__(self, paths: dict[str, Path], why_missing: str):
        self._paths, self._why = paths, why_missing

    def _get(self, key: str) -> Path:
        if key not in self._paths:
            pytest.skip(f"real artifact {REAL_ARTIFACTS[key]} unavailable: {self._why}")
        return self._paths[key]

    tiny_en = property(lambda self: self._get("tiny_en"))     # HF folder of openai/whisper-tiny.en
    base = property(lambda self: self._get("base"))           # HF folder of openai/whisper-base
    # manifest.jsonl: {"audio": file name beside it, "text": reference}
    manifest = property(lambda self: self._get("speech") / "manifest.jsonl")

    def clips(self) -> tuple[list[dict], list[tuple]]:
        """The LibriVox manifest rows and their audio as ``(float32 wave, sample rate)``."""
        import json

        manifest = self.manifest        # first: a machine without the clips skips, whatever it has installed
        import soundfile

        rows = [json.loads(line) for line in open(manifest)]
        return rows, [soundfile.read(str(manifest.parent / r["audio"]), dtype="float32") for r in rows]


@pytest.fixture(scope="session")
def real_whisper() -> RealWhisper:
    """Runs real_models.py (cached under $ENC2DEC_REAL_MODELS or ~/.cache/enc2dec-real). On an
    offline machine a folder already holding some artifacts serves those; a test that needs a
    missing one skips with the reason."""
    dest = Path(os.environ.get("ENC2DEC_REAL_MODELS") or Path.home() / ".cache" / "enc2dec-real")
    ready = {key: dest / name for key, name in REAL_ARTIFACTS.items()
             if (dest / name / ("manifest.jsonl" if key == "speech" else "config.json")).exists()}
    if len(ready) == len(REAL_ARTIFACTS):
        return RealWhisper(ready, "")
    if not REAL_MODELS_SCRIPT.is_file():
        return RealWhisper(ready, f"real Whisper checkpoints need {REAL_MODELS_SCRIPT}, which does not exist")
    cmd = [sys.executable, str(REAL_MODELS_SCRIPT), "--dest", str(dest)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True).stdout
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()[-1:] or ["no output"]
        return RealWhisper(ready, f"{REAL_MODELS_SCRIPT.name} failed (no network to PyPI?): {last[0]}")
    except subprocess.TimeoutExpired:
        return RealWhisper(ready, f"{REAL_MODELS_SCRIPT.name} timed out downloading the real Whisper checkpoints")
    paths = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    found = {key: Path(paths[name]) for key, name in REAL_ARTIFACTS.items() if name in paths}
    return RealWhisper(found, f"{REAL_MODELS_SCRIPT.name} did not report it")


@pytest.fixture(scope="module")
def real_tiny_llm(real_whisper):
    """An LLM on the real whisper-tiny.en checkpoint (one per test module)."""
    from enc2dec.engine import LLM, KvCacheConfig

    with LLM(str(real_whisper.tiny_en), kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        yield llm
