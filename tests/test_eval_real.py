"""enc2dec eval on real Whisper tiny.en and base with the LibriVox clips: token-for-token
parity with transformers in float32, the WER, and exit code 1 when a threshold is missed."""
from __future__ import annotations

import json

import pytest
from test_eval import eval_cli


def _eval(model, manifest, out, *checks):
    r = eval_cli("--task", "transcription", "--model", str(model), "--data", str(manifest),
                 "--min-parity", "1.0", *checks, "--report-json", str(out))
    return r, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.real
def test_real_whisper_transcription_parity_wer_and_exit_codes(real_whisper, tmp_path):
    # tiny.en: parity 1.0, and a WER threshold it cannot meet gives exit 1 (the report is still written)
    r, rep = _eval(real_whisper.tiny_en, real_whisper.manifest, tmp_path / "tiny.json", "--max-wer", "0.005")
    assert r.exit_code == 1, r.output
    assert rep["parity"]["exact_match"] == 1.0 and rep["parity"]["num_compared"] == 6
    wer = rep["metrics"]["enc2dec"]["wer"]
    assert 0.005 < wer < 0.15 and rep["metrics"]["hf"]["wer"] == wer
    assert [(c["option"], c["passed"]) for c in rep["checks"]] == [("--min-parity", True), ("--max-wer", False)]
    assert "CHECK FAILED: --max-wer 0.005" in r.output

    # base (multilingual: English transcription prefix): parity 1.0 and checks that pass
    r, rep = _eval(real_whisper.base, real_whisper.manifest, tmp_path / "base.json", "--max-wer", "0.15")
    assert r.exit_code == 0, r.output
    assert rep["parity"]["exact_match"] == 1.0 and rep["parity"]["num_compared"] == 6
    assert rep["decoding"]["whisper_prompt"] == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert rep["metrics"]["enc2dec"]["wer"] < 0.15 and rep["data"]["num_bad"] == 0
