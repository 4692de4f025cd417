"""Shared fixtures: tiny random checkpoints of every family (built once per session) and
the real Whisper checkpoints from ../shared/tools/real_models.py."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; the mode is read when triton is
# first imported (torch and transformers may import it early), so set it before anything runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny_models  # noqa: E402

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


@dataclass(frozen=True)
class RealWhisper:
    tiny_en: Path        # HF folder of openai/whisper-tiny.en weights
    base: Path           # HF folder of openai/whisper-base weights
    manifest: Path       # manifest.jsonl: {"audio": file name beside it, "text": reference}


@pytest.fixture(scope="session")
def real_whisper() -> RealWhisper:
    """Runs real_models.py (cached under $ENC2DEC_REAL_MODELS or ~/.cache/enc2dec-real);
    skips with the reason when the script is absent or cannot download."""
    if not REAL_MODELS_SCRIPT.is_file():
        pytest.skip(f"real Whisper checkpoints need {REAL_MODELS_SCRIPT}, which does not exist")
    cmd = [sys.executable, str(REAL_MODELS_SCRIPT)]
    if os.environ.get("ENC2DEC_REAL_MODELS"):
        cmd += ["--dest", os.environ["ENC2DEC_REAL_MODELS"]]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True).stdout
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"{REAL_MODELS_SCRIPT.name} failed (no network to PyPI?): {last[0]}")
    except subprocess.TimeoutExpired:
        pytest.skip(f"{REAL_MODELS_SCRIPT.name} timed out downloading the real Whisper checkpoints")
    paths = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    missing = {"whisper-tiny.en", "whisper-base", "speech"} - set(paths)
    if missing:
        pytest.skip(f"{REAL_MODELS_SCRIPT.name} did not report {', '.join(sorted(missing))}")
    return RealWhisper(Path(paths["whisper-tiny.en"]), Path(paths["whisper-base"]),
                       Path(paths["speech"]) / "manifest.jsonl")
