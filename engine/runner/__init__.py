"""GPU mechanism: the model runner (one engine step on the device), CUDA graphs, the
sampler, pinned host-to-device staging, weight loading and the fused one-row GEMV rewrite.
It runs what ``enc2dec.engine.core`` decided; it decides nothing."""
