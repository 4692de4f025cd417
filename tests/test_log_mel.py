"""Batched torch log-mel (the GPU feature path) agrees with transformers' WhisperFeatureExtractor."""
import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from enc2dec.engine.whisper.log_mel import LogMel


def test_batched_log_mel_matches_the_numpy_extractor():
    rng = np.random.RandomState(0)
    t = np.arange(16000 * 30) / 16000
    waves = [  # speech-like: tones with an envelope, noise, a short clip (zero-padded), silence-heavy
        (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 0.5 * t))).astype(np.float32),
        (0.05 * rng.randn(16000 * 30)).astype(np.float32),
        (0.2 * rng.randn(16000 * 7)).astype(np.float32),
        np.concatenate([np.zeros(16000 * 20), 0.1 * rng.randn(16000 * 3)]).astype(np.float32),
    ]
    for n_mels in (80, 128):
        fe = WhisperFeatureExtractor(feature_size=n_mels)
        ref = np.stack([fe(w, sampling_rate=16000, return_tensors="np").input_features[0] for w in waves])
        log_mel = LogMel(fe, torch.device("cpu"))
        got = log_mel(log_mel.batch([log_mel.clip(w) for w in waves])).numpy()
        assert got.shape == ref.shape == (4, n_mels, 3000)
        assert np.abs(got - ref).max() < 1e-3


def test_cpu_extractor_log_mel_is_the_extractor_bit_for_bit():
    # The CPU runner's features (from the padded raw wave, on the engine thread) must be exactly
    # what transformers feeds its model, or greedy tokens could drift from the reference.
    from enc2dec.engine.whisper.log_mel import ExtractorLogMel

    rng = np.random.RandomState(1)
    waves = [(0.1 * rng.randn(16000 * 30)).astype(np.float32), (0.2 * rng.randn(16000 * 7 + 123)).astype(np.float32)]
    fe = WhisperFeatureExtractor(feature_size=80)
    ref = np.stack([fe(w, sampling_rate=16000, return_tensors="np").input_features[0] for w in waves])
    log_mel = ExtractorLogMel(fe)
    got = log_mel(log_mel.batch([log_mel.clip(w) for w in waves]))
    assert got.dtype == torch.float32 and got.shape == (2, 80, 3000)
    assert np.array_equal(got.numpy(), ref)
