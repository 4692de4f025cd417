"""Whisper log-mel features on the device, for a whole encoder microbatch at once.

The same computation as transformers' WhisperFeatureExtractor (Hann-windowed STFT,
power spectrum, the checkpoint's mel filter bank, log10 with a floor, an 8-decade
dynamic range per clip, then (x + 4) / 4), but batched and left on the GPU so the CPU
never touches 30 s spectrograms. Agreement with the NumPy extractor: max abs difference
under 1e-3 on real speech (tests/test_log_mel.py); float32 throughout.
"""
from __future__ import annotations

import numpy as np
import torch

from enc2dec.engine.runner.cpu_threads import on_fresh_thread


def cpu_features(feature_extractor, wave: np.ndarray, rate: int) -> np.ndarray:
    """transformers' log-mel features of one clip, [n_mels, frames] float32: the CPU engine's
    encoder input, computed as the reference computes it.

    The extractor runs torch's CPU ops, and every thread that runs them keeps an OpenMP pool
    for the rest of its life. The caller's thread is not the engine thread, so its pool would
    be a second one beside the engine's on a machine whose cores one pool fills, and libgomp
    then sends every worker to sleep between parallel regions (engine/runner/cpu_threads.py):
    whisper-base's decode steps took ~1.3x as long (docs/benchmarks.md). On a thread that ends
    with the call, the pool ends with it."""
    return on_fresh_thread(lambda: feature_extractor(wave, sampling_rate=rate, return_tensors="np")
                           .input_features[0].astype(np.float32))


class LogMel:
    def __init__(self, feature_extractor, device: torch.device):
        fe = feature_extractor
        self.n_fft, self.hop = fe.n_fft, fe.hop_length
        self.num_samples = fe.n_samples                                   # 30 s at the checkpoint rate
        self.window = torch.hann_window(self.n_fft, device=device)
        self.filters = torch.as_tensor(np.asarray(fe.mel_filters), dtype=torch.float32,
                                       device=device).t().contiguous()   # [n_mels, n_freq]

    def pad(self, wave: np.ndarray) -> np.ndarray:
        """Zero-pad (the engine rejects longer clips beforehand) to the 30 s window."""
        out = np.zeros(self.num_samples, dtype=np.float32)
        out[:len(wave)] = wave[:self.num_samples]
        return out

    @torch.no_grad()
    def __call__(self, waves: torch.Tensor) -> torch.Tensor:
        # waves: [B, num_samples] float32 on the device
        stft = torch.stft(waves, self.n_fft, self.hop, window=self.window, return_complex=True)  # [B, F, T+1]
        power = stft[..., :-1].abs().square()                               # [B, F, T]
        mel = self.filters @ power                                          # [B, n_mels, T]
        log_spec = mel.clamp(min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)                      # [B, 1, 1]
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0
