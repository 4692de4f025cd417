"""Batch inference over Ray Data: one engine per actor, many actors over a cluster.

    import ray
    from enc2dec.engine.launch import build_llm_args
    from enc2dec.engine.whisper.ray_data import WhisperTranscriber, actor_options

    ds = ray.data.from_items([{"path": p} for p in paths])           # or {"bytes": audio_file_bytes}
    out = ds.map_batches(WhisperTranscriber, **actor_options(build_llm_args("./whisper-base"),
                                                             {"language": "en"}, concurrency=4))
    out.write_json("s3://bucket/transcripts")     # columns: source, text, language, duration_s, error, transcript

Each actor builds its ``LLM`` once (``__init__``) and transcribes the rows of every batch Ray
hands it with ``transcribe()``, so the engine's continuous batching works across a batch's files.
A row's ``transcript`` column is the pickled ``Transcript``: ``enc2dec transcribe --ray-address``
unpickles it and writes the same txt/srt/vtt/json/tsv files the single-process command writes.
``TextGenerator`` does the same for text prompts (eval rows: prompt -> generation).

Ray is imported only by the functions that start work on a cluster; the actor classes need
nothing of Ray themselves (Ray pickles the class and builds it on the worker).
"""
from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np

from .results import Transcript

# The row columns a transcription batch may carry: the file's bytes (what ray.data.read_binary_files
# gives; with include_paths=True its path names the row) or else a file path, which every worker
# must see (a shared file system).
PATH_COLUMN, BYTES_COLUMN = "path", "bytes"


def _llm(llm_args):
    from enc2dec.engine.launch import start_llm

    return start_llm(llm_args)


class WhisperTranscriber:
    """A ``map_batches`` callable: ``transcribe()`` keyword options in, one ``LLM`` per actor."""

    def __init__(self, llm_args, **transcribe_options):
        self.llm = _llm(llm_args)
        self.options = dict(transcribe_options)
        if self.options.get("timestamps") == "auto":         # json output: times when the checkpoint has them
            from .tokens import engine_whisper_info

            self.options["timestamps"] = engine_whisper_info(self.llm)[0].has_timestamps

    def __call__(self, batch: dict) -> dict:
        from .audio import AudioError, read_audio
        from .transcribe import transcribe

        if BYTES_COLUMN in batch:
            # read_binary_files(include_paths=True) names each row; plain bytes rows get an index.
            names = [str(p) for p in batch[PATH_COLUMN]] if PATH_COLUMN in batch else [
                f"<row {i}>" for i in range(len(batch[BYTES_COLUMN]))]
            sources: list = []
            for name, data in zip(names, batch[BYTES_COLUMN]):
                try:
                    sources.append((read_audio(bytes(data), self.sample_rate, name=name), self.sample_rate))
                except AudioError as e:
                    sources.append(e)
        elif PATH_COLUMN in batch:
            names = [str(p) for p in batch[PATH_COLUMN]]
            sources = list(names)
        else:
            raise ValueError(f"a transcription batch needs a {PATH_COLUMN!r} or {BYTES_COLUMN!r} column, "
                             f"got {sorted(batch)}")
        todo = [i for i, s in enumerate(sources) if not isinstance(s, AudioError)]
        done = transcribe(self.llm, [sources[i] for i in todo], **self.options) if todo else []
        results = [Transcript(source=n, error=str(s)) if isinstance(s, AudioError) else None
                   for n, s in zip(names, sources)]
        for i, t in zip(todo, done):
            t.source = names[i]        # array sources are named by their position otherwise
            results[i] = t
        return _columns(results)

    @property
    def sample_rate(self) -> int:
        from .tokens import engine_whisper_info

        return engine_whisper_info(self.llm)[1].sampling_rate

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _columns(results: Sequence[Transcript]) -> dict:
    return {
        "source": np.array([t.source for t in results], dtype=object),
        "text": np.array([t.text for t in results], dtype=object),
        "language": np.array([t.language or "" for t in results], dtype=object),
        "duration_s": np.array([t.duration_s for t in results], dtype=np.float64),
        "error": np.array([t.error or "" for t in results], dtype=object),
        "transcript": np.array([pickle.dumps(t) for t in results], dtype=object),
    }


class TextGenerator:
    """A ``map_batches`` callable for text rows: ``prompt`` in, ``generation`` (and ``finish_reason``)
    out, greedy unless ``sampling`` (``SamplingParams`` keywords) says otherwise."""

    def __init__(self, llm_args, sampling: dict | None = None):
        from enc2dec.engine import SamplingParams

        self.llm = _llm(llm_args)
        self.params = SamplingParams(**{"temperature": 0.0, **(sampling or {})})

    def __call__(self, batch: dict) -> dict:
        outs = self.llm.generate([str(p) for p in batch["prompt"]], self.params, use_tqdm=False)
        return {**batch, "generation": np.array([o.outputs[0].text for o in outs], dtype=object),
                "finish_reason": np.array([o.outputs[0].finish_reason for o in outs], dtype=object)}

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def actor_options(llm_args, options: dict | None = None, *, concurrency: int = 1, rows_per_batch: int = 32,
                  num_gpus: float | None = None, num_cpus: float = 1) -> dict:
    """``map_batches`` keywords for one of the classes above: ``options`` are its constructor's
    keywords (``transcribe()``'s for ``WhisperTranscriber``, ``sampling`` for ``TextGenerator``);
    ``concurrency`` actors, each holding ``tensor_parallel_size`` GPUs on a CUDA engine
    (``num_gpus`` overrides) and none on the CPU; ``rows_per_batch`` rows per call."""
    from ray.data import ActorPoolStrategy

    from enc2dec.engine.ray_cluster import gpus_per_engine

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    if num_gpus is None:
        num_gpus = gpus_per_engine(llm_args)
    return dict(fn_constructor_args=(llm_args,), fn_constructor_kwargs=dict(options or {}),
                compute=ActorPoolStrategy(size=concurrency), batch_size=rows_per_batch, num_gpus=num_gpus,
                num_cpus=num_cpus)


def transcribe_files(files: Sequence[str], llm_args, *, concurrency: int = 1, files_per_batch: int = 8,
                     num_gpus: float | None = None, **transcribe_options) -> list[Transcript]:
    """``transcribe()`` over a Ray cluster (``ray.init`` already called): the files are split into
    batches of ``files_per_batch`` over ``concurrency`` actors; transcripts come back in input order."""
    import ray

    ds = ray.data.from_items([{PATH_COLUMN: f} for f in files])
    out = ds.map_batches(WhisperTranscriber, **actor_options(llm_args, transcribe_options, concurrency=concurrency,
                                                             rows_per_batch=files_per_batch, num_gpus=num_gpus))
    by_source = {}
    for row in out.iter_rows():
        t = pickle.loads(row["transcript"])
        by_source[t.source] = t
    return [by_source[f] for f in files]
