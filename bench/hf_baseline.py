"""The obvious alternative, measured on the same requests: ``transformers`` ``generate``.

``hf``: the checkpoint's model class (``AutoModelForSeq2SeqLM`` / ``AutoModelForSpeechSeq2Seq``)
built from the same config (random weights for ``load_format=dummy``, the folder's weights
otherwise), same dtype and device, eager, dynamic cache. ``hf-compile``: the same plus
``cache_implementation="static"`` and a ``CompileConfig``, so ``generate`` runs its decode
steps through ``torch.compile`` (transformers does this only on CUDA).

Requests run in static batches of the concurrency level, decoding as the engine does
(``engine_generation_config``: greedy or ``--beam-width`` beams; no sampling, n-gram
blocking or penalties), with
``min_new_tokens = max_new_tokens`` = the longest output length in the batch, so lengths
match the engine's. Each request counts its own output length. Token times come from a
generation streamer: ``generate`` hands it every step's tokens with ``.cpu()``, which waits
for the GPU, so its timestamps are when each step's tokens existed. Every request of a
batch shares the batch's timestamps: sent at batch start (feature extraction and padding
included), first token at the first streamed step, done when ``generate`` returns.
"""
from __future__ import annotations

import contextlib
import time

from .errors import BenchInputError
from .loop import Progress
from .metrics import RequestRecord
from .workloads import BenchRequest

BASELINES = ("hf", "hf-compile")


class _TimingStreamer:
    """Records when each step's tokens reach the host; the first put is the decoder prompt."""

    def __init__(self):
        self.times_s: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times_s.append(time.monotonic())

    def end(self) -> None:
        pass


def resolve_device_dtype(device: str, dtype: str, hf_config):
    """The engine's rule: auto device = CUDA when visible; auto dtype = float32 on CPU, on GPU
    bfloat16 unless the checkpoint is float16."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype not in ("auto", None):
        aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}
        return dev, getattr(torch, aliases.get(dtype, dtype))
    if dev.type == "cpu":
        return dev, torch.float32
    ckpt = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", ""))
    return dev, torch.float16 if ckpt.endswith("float16") and "b" not in ckpt else torch.bfloat16


class HfBaseline:
    def __init__(self, kind: str, model: str, load_format: str, device, dtype, num_beams: int = 1):
        if kind not in BASELINES:
            raise BenchInputError(f"--baseline {kind!r} is not valid; valid: {', '.join(BASELINES)}")
        from enc2dec.engine.inputs.hf_reference import engine_generation_config, load_hf_model
        from enc2dec.engine.inputs.model_source import resolve_model

        self.name = kind
        try:
            src = resolve_model(model, None, load_format)
        except ValueError as e:
            raise BenchInputError(f"--baseline {kind}: {e}") from None
        if kind == "hf-compile" and device.type != "cuda":
            raise BenchInputError("--baseline hf-compile needs a CUDA GPU (transformers compiles generate's "
                                  "forward only there); use --baseline hf on the CPU")
        self.hf = load_hf_model(src, device, dtype, load_format)
        self.device, self.is_whisper, self.tokenizer = self.hf.device, self.hf.is_whisper, src.tokenizer
        gen, _ = engine_generation_config(src.generation_config, src.hf_config, num_beams)
        if kind == "hf-compile":
            from transformers import CompileConfig

            gen.cache_implementation = "static"
            gen.compile_config = CompileConfig()
        self.hf.use_generation_config(gen)
        self.generation_config = gen
        self.static_input_len: int | None = None   # hf-compile pads every batch to one length

    # ---- one static batch -------------------------------------------------------------------
    def _inputs(self, batch: list[BenchRequest]) -> tuple[dict, list[int]]:
        if self.is_whisper:
            inputs = self.hf.audio_batch([r.prompt["multi_modal_data"]["audio"][0][0] for r in batch])
            if getattr(self.generation_config, "lang_to_id", None):
                inputs.update(language="en", task="transcribe")
            return inputs, [0] * len(batch)
        ids = []
        for r in batch:
            if r.is_text:
                if self.tokenizer is None:
                    raise BenchInputError(f"{r.source}: a text prompt needs a tokenizer, and this model has "
                                          "none (dummy weights); send input_ids rows instead")
                ids.append(self.tokenizer(r.prompt).input_ids)
            else:
                ids.append(list(r.prompt))
        return self.hf.token_batch(ids, self.static_input_len or 0), [len(x) for x in ids]

    def run_batch(self, batch: list[BenchRequest]) -> list[RequestRecord]:
        import torch

        start = time.monotonic()
        inputs, in_lens = self._inputs(batch)
        n_new = max(r.output_len for r in batch)
        # transformers cannot stream beam search: beams then get no per-token times (no TTFT/TPOT).
        streamer = _TimingStreamer() if self.generation_config.num_beams == 1 else None
        try:
            self.hf.generate(inputs, self.generation_config, max_new_tokens=n_new, min_new_tokens=n_new,
                             pad_token_id=self.hf.pad_id, streamer=streamer)
            error = None
        except torch.cuda.OutOfMemoryError as e:     # the batch fails; smaller levels' results stand
            error = f"out of GPU memory: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
        end = time.monotonic()
        times_s = streamer.times_s if streamer is not None else []
        produced = len(times_s) if streamer is not None else (0 if error else n_new)
        records = []
        for r, n_in in zip(batch, in_lens):
            n_out = min(r.output_len, produced)
            records.append(RequestRecord(start_s=start, end_s=end, token_times_s=times_s[:n_out],
                                         input_len=n_in, output_len=n_out, audio_s=r.audio_s, error=error))
        return records

    # ---- one level ----------------------------------------------------------------------------
    def run_level(self, requests: list[BenchRequest], concurrency: int, num_requests: int | None,
                  duration_s: float | None, warmup: int,
                  progress: Progress | None = None) -> tuple[list[RequestRecord], float, dict]:
        if self.name == "hf-compile" and not self.is_whisper:
            self.static_input_len = max(r.input_len for r in requests) or None

        def batch_at(i: int, size: int) -> list[BenchRequest]:
            return [requests[(i + k) % len(requests)] for k in range(size)]

        if warmup > 0:       # one batch of each size the level will run: compile and allocator warm-up
            sizes = {concurrency}
            if num_requests is not None and num_requests % concurrency:
                sizes.add(num_requests % concurrency)
            for size in sorted(sizes):
                self.run_batch(batch_at(0, size))
        mem = self._reset_peak()
        records: list[RequestRecord] = []
        start = time.monotonic()
        while True:
            done = len(records)
            if num_requests is not None and done >= num_requests:
                break
            if duration_s is not None and time.monotonic() - start >= duration_s:
                break
            size = concurrency if num_requests is None else min(concurrency, num_requests - done)
            records += self.run_batch(batch_at(warmup + done, size))
            if progress is not None:
                progress.advance(size)
        duration = max((r.end_s for r in records), default=start) - start
        return records, duration, mem()

    def _reset_peak(self):
        import torch

        if self.device.type != "cuda":
            return dict
        torch.cuda.reset_peak_memory_stats(self.device)
        return lambda: {"peak_gpu_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.hf.close()
