"""Batched torch log-mel (the GPU feature path) agrees with transformers' WhisperFeatureExtractor."""
import os
import subprocess
import sys

import numpy as np
import pytest
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
        got = log_mel(torch.from_numpy(np.stack([log_mel.pad(w) for w in waves]))).numpy()
        assert got.shape == ref.shape == (4, n_mels, 3000)
        assert np.abs(got - ref).max() < 1e-3


_POOL_CHECK = r"""
import os, time, numpy as np, torch
from transformers import WhisperFeatureExtractor
from enc2dec.engine.whisper.log_mel import cpu_features
threads = lambda: len(os.listdir("/proc/self/task"))
fe = WhisperFeatureExtractor()
wave = (0.1 * np.random.RandomState(0).randn(16000 * 5)).astype(np.float32)
before = threads()
got = cpu_features(fe, wave, 16000)
for _ in range(100):          # the ended thread's workers exit on their own, shortly after it
    if threads() <= before:
        break
    time.sleep(0.02)
after = threads()
ref = fe(wave, sampling_rate=16000, return_tensors="np").input_features[0]   # on this thread: it keeps a pool
print(before, after, threads(), got.dtype, "x".join(map(str, got.shape)), bool(np.array_equal(got, ref)))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="counts OpenMP worker threads through /proc; needs 2+ threads")
def test_cpu_features_leave_the_callers_thread_without_an_openmp_pool():
    # A fresh interpreter: pytest's own thread may hold a pool from earlier tests.
    out = subprocess.run([sys.executable, "-c", _POOL_CHECK], capture_output=True, text=True, check=True).stdout
    before, after, with_pool, dtype, shape, equal = out.split(maxsplit=5)
    assert after == before                     # the engine thread's pool stays the only one
    assert int(with_pool) > int(before)        # the check can see a pool when one is made
    assert (dtype, shape, equal.strip()) == ("float32", "80x3000", "True")
