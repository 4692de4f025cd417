"""What a bench run is asked to do: ``BenchOptions`` (validated), and the workload they make."""
from __future__ import annotations

import dataclasses
import importlib.util
import random
from dataclasses import dataclass, field

from .errors import BenchInputError
from .thresholds import Threshold
from .workloads import BenchRequest, HfDatasetSpec, LengthDist

DEFAULT_AUDIO_SECONDS = 30.0


@dataclass
class BenchOptions:
    model: str | None = None
    load_format: str | None = None          # None: the config's (else the engine's default, auto)
    dtype: str | None = None
    device: str | None = None
    config: str | None = None               # YAML of LLM keys
    engine_overrides: dict = field(default_factory=dict)   # max_batch_size, ... from the command line
    concurrency: tuple[int, ...] = (1,)
    num_requests: tuple[int, ...] | None = None   # one for all levels or one per level; None: max(4 x C, 32)
    duration_s: float | None = None
    warmup: int = 2
    input_len: int = 128
    output_len: int = 128
    input_dist: str = "fixed"
    output_dist: str = "fixed"
    seed: int = 0
    dataset: str | None = None
    hf_dataset: HfDatasetSpec | None = None
    audio_dir: str | None = None
    audio_manifest: str | None = None
    audio_seconds: float | None = None
    streaming: bool = False
    beam_width: int = 1                     # > 1: beam search (best_of=K, n=1); baselines num_beams=K
    # Sampled decoding on the in-process engine (None: greedy); request i of the workload gets
    # seed sampling_seed + i
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    sampling_seed: int | None = None
    # Whisper on the in-process engine: every N-th request of the workload decodes with the
    # timestamp prompt and rules (1: all; None: none); the first output token detects the language
    timestamps_every: int | None = None
    detect_language: bool = False
    baselines: tuple[str, ...] = ()
    url: str | None = None
    client_processes: int | None = None     # --url: client processes (None: one per 8 streams, bench/http_shards.py)
    ready_timeout_s: float | None = None    # --url: longest wait for a server still loading (None: 600 s)
    thresholds: tuple[Threshold, ...] = ()
    command: str | None = None

    def validate(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchInputError(f"--concurrency needs integers >= 1, got {list(self.concurrency)}")
        if isinstance(self.num_requests, int):
            self.num_requests = (self.num_requests,)
        if self.num_requests is not None:
            if any(n < 1 for n in self.num_requests):
                raise BenchInputError(f"--num-requests must be >= 1, got {list(self.num_requests)}")
            if len(self.num_requests) not in (1, len(self.concurrency)):
                raise BenchInputError(f"--num-requests has {len(self.num_requests)} values for "
                                      f"{len(self.concurrency)} concurrency levels; give one, or one per level")
        if self.duration_s is not None and self.duration_s <= 0:
            raise BenchInputError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.warmup < 0:
            raise BenchInputError(f"--warmup must be >= 0, got {self.warmup}")
        if self.client_processes is not None:
            if self.client_processes < 1:
                raise BenchInputError(f"--client-processes must be >= 1, got {self.client_processes}")
            if self.url is None:
                raise BenchInputError("--client-processes is for --url (a server); the in-process engine "
                                      "has no client to spread")
        if self.ready_timeout_s is not None:
            if self.url is None:
                raise BenchInputError("--ready-timeout is for --url (a server that may still be loading)")
            if not self.ready_timeout_s >= 0:
                raise BenchInputError(f"--ready-timeout must be >= 0 seconds, got {self.ready_timeout_s}")
        if self.beam_width < 1:
            raise BenchInputError(f"--beam-width must be >= 1 (1: greedy), got {self.beam_width}")
        if self.beam_width > 1 and self.url and self.is_audio_requested:
            raise BenchInputError("--beam-width with --url benches text completions only: the server's "
                                  "/v1/audio/transcriptions has no beam fields")
        self._validate_sampling()
        self._validate_whisper_rules()
        sources = [name for name, v in (("--dataset", self.dataset), ("--hf-dataset", self.hf_dataset),
                                        ("--audio-dir", self.audio_dir), ("--audio-manifest", self.audio_manifest))
                   if v]
        if len(sources) > 1:
            raise BenchInputError(f"use one workload source, got {' and '.join(sources)}")
        if self.audio_seconds is not None and sources:
            raise BenchInputError(f"--audio-seconds makes synthetic clips; it does not go with {sources[0]}")
        if self.url is None and not self.model:
            raise BenchInputError("--model is required (a Hugging Face folder, a hub id, or with "
                                  "--load-format dummy a known name such as google/flan-t5-small)")
        if self.baselines and not self.model:
            raise BenchInputError("--baseline needs --model: the baseline builds the model itself")
        # optional packages: fail before minutes of engine start-up, not after
        for needed, package, hint in ((self.hf_dataset, "datasets", "--hf-dataset needs 'datasets'"),
                                      (self.url, "httpx", "--url needs 'httpx'")):
            if needed and importlib.util.find_spec(package) is None:
                raise BenchInputError(f"{hint}, which is not installed: pip install {package}")

    def _validate_sampling(self) -> None:
        if self.temperature is not None and not self.temperature >= 0:
            raise BenchInputError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise BenchInputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise BenchInputError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if not self.sampling:
            return
        names = ", ".join(f"--{k.replace('_', '-')}" for k in self.sampling)
        for on, what in ((self.beam_width > 1, "--beam-width"), (self.url, "--url"), (self.baselines, "--baseline")):
            if on:
                raise BenchInputError(f"{names} sample on the in-process engine, which {what} does not bench "
                                      f"(it decodes greedily or with beams); drop one of them")

    def _validate_whisper_rules(self) -> None:
        if self.timestamps_every is not None and (isinstance(self.timestamps_every, bool)
                                                  or self.timestamps_every < 1):
            raise BenchInputError(f"--timestamps-every must be an integer >= 1 (1: every request), "
                                  f"got {self.timestamps_every}")
        names = [n for n, on in (("--timestamps", self.timestamps_every is not None),
                                 ("--detect-language", self.detect_language)) if on]
        for on, what in ((self.url, "--url"), (self.baselines, "--baseline")):
            if names and on:
                raise BenchInputError(f"{' and '.join(names)} decode on the in-process engine, which {what} does "
                                      f"not bench (its requests use the checkpoint's default prompt); drop one")

    @property
    def sampling(self) -> dict:
        """The sampling options given, as SamplingParams names (the report records them)."""
        return {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                  ("top_k", self.top_k), ("sampling_seed", self.sampling_seed)) if v is not None}

    def request_sampling(self, i: int) -> dict:
        """SamplingParams keywords for request ``i`` of the workload ({}: greedy)."""
        kw = {k: v for k, v in self.sampling.items() if k != "sampling_seed"}
        if self.sampling_seed is not None:
            kw["seed"] = self.sampling_seed + i
        if kw and self.temperature is None:
            kw["temperature"] = 1.0
        return kw

    def level_num_requests(self, concurrency: int) -> int | None:
        if self.num_requests is not None:
            if len(self.num_requests) == 1:
                return self.num_requests[0]
            return self.num_requests[list(self.concurrency).index(concurrency)]
        return None if self.duration_s is not None else max(4 * concurrency, 32)

    @property
    def is_audio_requested(self) -> bool:
        return bool(self.audio_dir or self.audio_manifest or self.audio_seconds is not None
                    or (self.hf_dataset and self.hf_dataset.audio_field))


def build_workload(opts: BenchOptions, is_whisper: bool, vocab_size: int | None) -> tuple[list[BenchRequest], dict]:
    """The requests every backend replays (cycled when a level needs more), and their description."""
    from . import audio, workloads

    in_dist = LengthDist.parse(opts.input_dist, opts.input_len, "--input-dist")
    out_dist = LengthDist.parse(opts.output_dist, opts.output_len, "--output-dist")
    needed = opts.warmup + max(opts.level_num_requests(c) or 4 * c for c in opts.concurrency)
    desc = {"output_len": opts.output_len, "output_dist": opts.output_dist, "seed": opts.seed}
    if opts.is_audio_requested != is_whisper and opts.url is None:
        raise BenchInputError("audio workloads (--audio-*, --hf-audio-field) need a Whisper model" if not is_whisper
                              else f"{opts.model} is a Whisper model: bench it on audio (--audio-seconds, "
                                   "--audio-dir, --audio-manifest or --hf-dataset with --hf-audio-field)")
    if opts.dataset:
        reqs = workloads.load_jsonl(opts.dataset, opts.output_len, limit=needed)
        desc.update(kind="jsonl", path=opts.dataset)
    elif opts.hf_dataset:
        reqs = workloads.load_hf_dataset(opts.hf_dataset, opts.output_len, limit=needed)
        desc.update(kind="hf-dataset", **dataclasses.asdict(opts.hf_dataset))
    elif opts.audio_dir:
        reqs = audio.audio_dir_requests(opts.audio_dir, opts.output_len, limit=needed)
        desc.update(kind="audio-dir", path=opts.audio_dir)
    elif opts.audio_manifest:
        reqs = audio.audio_manifest_requests(opts.audio_manifest, opts.output_len, limit=needed)
        desc.update(kind="audio-manifest", path=opts.audio_manifest)
    elif is_whisper:
        seconds = opts.audio_seconds if opts.audio_seconds is not None else DEFAULT_AUDIO_SECONDS
        out_lens = out_dist.sample(needed, random.Random(opts.seed))
        reqs = audio.synthetic_audio_requests(needed, seconds, out_lens, opts.seed)
        desc.update(kind="audio-synthetic", audio_seconds=seconds)
    else:
        reqs = workloads.synthetic_requests(needed, in_dist, out_dist, opts.seed, vocab_size)
        desc.update(kind="synthetic", input_len=opts.input_len, input_dist=opts.input_dist)
    if opts.sampling:
        reqs = [dataclasses.replace(r, sampling=opts.request_sampling(i)) for i, r in enumerate(reqs)]
        desc["sampling"] = opts.sampling
    if opts.timestamps_every is not None or opts.detect_language:
        if not is_whisper:
            raise BenchInputError("--timestamps / --timestamps-every / --detect-language need a Whisper model")
        from .whisper_rules import describe

        desc["whisper"] = describe(opts.timestamps_every, opts.detect_language, len(reqs))
    desc["num_distinct_requests"] = len(reqs)
    return reqs, desc


def cycle_requests(reqs: list[BenchRequest], n: int) -> list[BenchRequest]:
    """The first ``n`` requests of ``reqs`` repeated as often as needed."""
    return [reqs[i % len(reqs)] for i in range(n)]


def _split_warmup(reqs: list[BenchRequest], warmup: int) -> tuple[list[BenchRequest], list[BenchRequest]]:
    warm = cycle_requests(reqs, warmup)
    measured = reqs[warmup:] if len(reqs) > warmup else reqs
    return warm, measured
