"""The engine: input processing, the step loop and output processing, in one thread.

    step():  schedule -> launch -> advance -> resolve (overlap: the previous step) -> outputs

``make_request`` validates and may raise ``ValueError``; it runs in the caller's thread and
touches no engine state, so a bad request never disturbs the requests in flight.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from enc2dec.engine.core.admission import encoder_admission
from enc2dec.engine.core.batch import SchedulerOutput
from enc2dec.engine.core.beam_search import BeamState, Hypothesis
from enc2dec.engine.config import LlmArgs
from enc2dec.engine.inputs.detokenizer import IncrementalDetokenizer
from enc2dec.engine.parallel.distributed import TensorParallelError
from enc2dec.engine.inputs.processor import InputProcessor, ProcessedInput
from enc2dec.engine.runner.model_runner import ModelRunner
from enc2dec.engine.inputs.model_source import resolve_model
from enc2dec.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from enc2dec.engine.core.request import LIVE_STATUSES, PLACEHOLDER_TOKEN_ID, Request, RequestStatus, Sequence
from enc2dec.engine.runner.sampler import SeqSamplingState
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.core.scheduler import Scheduler, SchedulerLimits

logger = logging.getLogger("enc2dec")

WHISPER_ENCODER_LEN = 1500


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but no CUDA GPU is visible; use device='cpu'")
    return torch.device(name)


def _resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    # float32 checkpoints run in bfloat16 (T5 overflows float16); float16 ones stay float16.
    return torch.float16 if str(ckpt) in ("float16", "torch.float16") else torch.bfloat16


def _resolve_attn_backend(name: str, device: torch.device) -> str:
    if device.type != "cuda":
        if name not in ("auto", "torch", "VANILLA"):
            logger.info("attn_backend=%s runs its torch reference on the CPU", name)
        return "torch"
    if name != "auto":
        return name
    from enc2dec.kernels import triton_available

    return "triton" if triton_available() else "torch"


def _check_fits_model(params: SamplingParams, vocab_size: int) -> None:
    """Values the sampler indexes or converts to tensors: a bad one must fail this request at
    submit, never the batch it would have joined (an out-of-vocabulary stop id or an
    overflowing top_k would raise inside a shared step)."""
    params.validate()            # the fields may have changed since the params were built
    for name, ids in (("stop_token_ids / end_id",
                       [*(params.stop_token_ids or ()), *(() if params.end_id is None else (params.end_id,))]),
                      ("bad_token_ids", params.bad_token_ids or ()), ("logit_bias", list(params.logit_bias or ()))):
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.top_k is not None and params.top_k > vocab_size:
        raise ValueError(f"top_k must be an integer <= the vocabulary size {vocab_size}, got {params.top_k!r}")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs must be in [0, {vocab_size}], got {params.logprobs}")
    bad = [t for t in params.prefix_logprob_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prefix_logprob_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _check_beam_search(params: SamplingParams, max_beam_width: int) -> None:
    width = params.beam_width
    if width > max_beam_width:
        raise ValueError(f"best_of={width} (the beam width) exceeds max_beam_width={max_beam_width}, the "
                         f"capacity reserved at start-up; lower best_of or start LLM(max_beam_width={width})")
    unsupported = [name for name, on in (
        ("temperature > 0", bool(params.temperature)), ("top_k", bool(params.top_k)),
        ("top_p < 1", params.top_p not in (None, 1.0)), ("min_p", bool(params.min_p)),
        ("stop strings", bool(params.stop)), ("repetition/presence/frequency penalties", params.has_penalties),
        ("logit_bias", bool(params.logit_bias))) if on]
    if unsupported:
        raise ValueError(f"use_beam_search=True does not support {', '.join(unsupported)}: beam search is "
                         "deterministic and ranks whole hypotheses; drop these options or decode without beams")


@dataclass(slots=True)
class _Tracked:
    request: Request
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    streaming: bool
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    num_seen_tokens: int = 0     # output tokens of all sequences already reported
    # Outputs as deltas (the change since the last output; EngineCore._delta) instead of
    # cumulative lists; per sequence [output ids, text characters, logprobs] already sent.
    deltas: bool = False
    sent: list[list[int]] | None = None
    num_sent_times: int = 0
    # Streamed text and stop strings need the text as it grows; beams reorder, so they are
    # decoded once, at the end (and take no stop strings).
    detokenizes_per_step: bool = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizes_per_step = (self.streaming or bool(self.params.stop)) and self.request.beam is None


@dataclass(slots=True)
class StepCounters:
    """What the step loop has done since start-up, in plain counters (read from any thread).
    A benchmark takes their change over a window: the mean step time and rows per step say
    whether throughput was lost in the engine (slower or emptier steps) or around it, and the
    share of step time spent waiting for the device says whether the host or the device bounds
    the loop."""

    num_steps: int = 0            # steps that launched work
    num_rows: int = 0             # decoder rows launched, over those steps
    num_encodes: int = 0          # requests encoded
    step_s: float = 0.0           # time inside step()
    device_wait_s: float = 0.0    # of which waiting for a launched step's results
    # Requests that finished, and their times in the engine summed (arrival = make_request): set
    # beside a client's own TTFT and latency they say how long a request spent outside the engine
    # (a server's API processes, the wire, the client).
    num_finished: int = 0
    first_token_s: float = 0.0    # arrival to first token
    finish_s: float = 0.0         # arrival to finish

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class EngineCore:
    def __init__(self, args: LlmArgs):
        self.args = args
        src = resolve_model(args.model, args.tokenizer, args.load_format, args.trust_remote_code)
        self.hf_config = src.hf_config
        self.tokenizer = src.tokenizer
        self.is_whisper = src.hf_config.model_type == "whisper"
        self.device = _resolve_device(args.device)
        self.dtype = _resolve_dtype(args.dtype, src.hf_config, self.device)
        max_input_len = args.max_input_len or (WHISPER_ENCODER_LEN if self.is_whisper else 1024)
        if self.is_whisper and max_input_len < WHISPER_ENCODER_LEN:
            raise ValueError(f"max_input_len={max_input_len} is too small for Whisper: every request produces "
                             f"{WHISPER_ENCODER_LEN} encoder positions; set max_input_len >= {WHISPER_ENCODER_LEN}")
        if args.kv_cache_config.cross_kv_cache_fraction is None:
            raise ValueError("kv_cache_config.cross_kv_cache_fraction is required for encoder-decoder models: "
                             "it splits the KV budget between the cross- and self-attention pools; "
                             "0.5 is a reasonable start, e.g. KvCacheConfig(cross_kv_cache_fraction=0.5)")
        self.limits = SchedulerLimits(
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            encoder_max_batch_size=args.encoder_max_batch_size or args.max_batch_size,
            encoder_max_num_tokens=args.encoder_max_num_tokens or args.max_num_tokens,
            tokens_per_block=args.kv_cache_config.tokens_per_block)
        if max_input_len > min(self.limits.encoder_max_num_tokens, self.limits.max_num_tokens):
            raise ValueError(f"max_input_len={max_input_len} exceeds the per-step encoder token budget "
                             f"(encoder_max_num_tokens={self.limits.encoder_max_num_tokens}, max_num_tokens="
                             f"{self.limits.max_num_tokens}): the whole encoder input must fit in one step")
        # Built before the weights load: a checkpoint without start tokens fails fast.
        self.processor = InputProcessor(src.hf_config, src.generation_config, src.tokenizer, max_input_len,
                                        args.max_seq_len, src.feature_extractor)
        attn = _resolve_attn_backend(args.attn_backend, self.device)
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        if args.tensor_parallel_size > 1:
            from enc2dec.engine.parallel.tensor_parallel import start_tensor_parallel

            self.runner = start_tensor_parallel(args, src, self.device, self.dtype, attn, max_input_len)
        else:
            self.runner = ModelRunner(args, src.hf_config, src.path, self.device, self.dtype, attn, max_input_len,
                                      src.feature_extractor)
        self.processor.log_mel = self.runner.log_mel
        plan = self.runner.kv_plan
        kv_dtype = "fp8 e4m3" if args.kv_cache_config.dtype == "fp8" else str(self.dtype).replace("torch.", "")
        logger.info("loaded %s (%s, %s, attention=%s) in %.1f s; KV (%s): %s", args.model, self.device,
                    str(self.dtype).replace("torch.", ""), attn, time.perf_counter() - t0, kv_dtype,
                    plan.describe(max_input_len, args.max_seq_len or 256))
        cfg = src.hf_config
        per_row = args.tuning.encoder_tokens_per_decoding_row
        tokens, join = encoder_admission(
            args.tuning, self.is_whisper, getattr(cfg, "encoder_layers", 0), getattr(cfg, "decoder_layers", 0),
            max_input_len, getattr(self.runner, "encodes_beside", False))    # a tensor-parallel driver has none
        self.limits = dataclasses.replace(self.limits, feed_prompt_one_token_per_step=self.runner.graphs is not None,
                                          encoder_max_num_tokens_while_decoding=tokens, defer_joins_while_decoding=join,
                                          encoder_max_num_tokens_per_decoding_row=per_row)
        if tokens or join or per_row:      # what tuning's auto values (0) resolved to for this model and device
            beside = f", encoded beside the decoder, joining {join} step{'s' * (join > 1)} later" if join else ""
            bound = " and ".join(filter(None, [f"{tokens}" if tokens else "",
                                               f"{per_row} per decoding row" if per_row else ""])) or "unbounded"
            logger.info("admission while decoding: %s encoder positions a step%s", bound, beside)
        self.scheduler = Scheduler(self.limits, plan.num_self_blocks, plan.num_cross_blocks)
        # Tensor parallel: rank 0 captured the buckets every rank did (the same arguments).
        encoder_graphs = getattr(self.runner, "encoder_graphs", None)
        if args.tuning.encoder_batches_fit_graphs and encoder_graphs is not None and encoder_graphs.pad_batch:
            self.scheduler.encoder_graph_positions = encoder_graphs.positions
        self._live: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        # Overlap: step N+1 is scheduled and launched while the GPU runs step N. On the CPU a launch
        # returns with the step computed, so there is nothing to overlap and, unless asked for,
        # it is off: with it, every output (the first token too) would wait one more step.
        self.overlap = args.disable_overlap_scheduler is False or (
            args.disable_overlap_scheduler is None and self.device.type == "cuda")
        self._inflight = None                      # (SchedulerOutput, PendingStep) not yet resolved
        self.counters = StepCounters()
        # Everything alive now (torch, transformers, the model: ~360k objects for flan-t5-small)
        # lives as long as the engine; a full collection scans it all, about 100 ms on the CI
        # machine type, a stall of the step loop whenever garbage from requests triggers one.
        # Frozen, it is skipped; shutdown() hands it back to the collector.
        gc.collect()
        gc.freeze()

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt, params: SamplingParams | None, streaming: bool = False,
                     request_id: str | None = None, deltas: bool = False) -> _Tracked:
        """``deltas``: this request's outputs are deltas, each only what changed since the previous
        one (``_delta``: the engine process's wire form), instead of cumulative ``RequestOutput``s."""
        params = params or SamplingParams()
        _check_fits_model(params, self.processor.vocab_size)
        if params.use_beam_search:
            _check_beam_search(params, self.args.max_beam_width)
        proc: ProcessedInput = self.processor.process(prompt, params.max_tokens)
        if params.prefix_logprob_token_ids and params.prefix_logprob_position >= len(proc.decoder_prefix):
            raise ValueError(f"prefix_logprob_position={params.prefix_logprob_position} is not inside the decoder "
                             f"prefix ({len(proc.decoder_prefix)} tokens)")
        eos = (params.end_id,) if params.end_id is not None else self.processor.eos_token_ids
        spec = SeqSamplingState(params, tuple(eos), tuple(params.stop_token_ids or ()),
                                self.processor.suppress_token_ids, self.processor.begin_suppress_token_ids,
                                prefix_token_ids=tuple(proc.decoder_prefix[:proc.num_hidden_tokens]))
        # Beam search starts from one sequence and forks it; n then counts returned hypotheses.
        num_seqs = 1 if params.use_beam_search else params.n
        seqs = [Sequence(token_ids=list(proc.decoder_prefix), num_hidden_tokens=proc.num_hidden_tokens, index=i)
                for i in range(num_seqs)]
        req = Request(request_id=request_id or f"req-{next(self._ids)}", encoder_len=proc.encoder_len,
                      encoder_input=proc.encoder_input, seqs=seqs, max_output_tokens=proc.max_output_tokens,
                      sampling_params=spec, eos_token_ids=frozenset(eos),
                      stop_token_ids=frozenset(params.stop_token_ids or ()), ignore_eos=params.ignore_eos,
                      min_tokens=params.min_tokens, needs_host_tokens=params.needs_host_tokens,
                      encoder_cache_key=proc.encoder_cache_key)
        if params.use_beam_search:
            req.beam = BeamState(params.beam_width, params.n, params.length_penalty, params.early_stopping,
                                 keep_logprobs=params.logprobs is not None,
                                 needs_token_ids=bool(params.logits_processors))
        reason = self.scheduler.check_admissible(req)
        if reason:
            raise ValueError(f"request cannot be scheduled with this engine's limits: {reason}")
        tok = self.tokenizer if params.detokenize else None
        detoks = [IncrementalDetokenizer(tok, params.skip_special_tokens, params.stop,
                                         params.include_stop_str_in_output) for _ in seqs]
        return _Tracked(req, proc.prompt, proc.prompt_token_ids, params, streaming, detoks,
                        RequestMetrics(arrival_time=req.arrival_time), deltas=deltas)

    def add(self, tracked: _Tracked) -> None:
        self._live[tracked.request.request_id] = tracked
        self.scheduler.add_request(tracked.request)

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        tracked = self._live.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        tracked.error = error
        return self._output(tracked, finished=True)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.counters.step_s += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        """schedule -> launch -> advance -> resolve the previous step (overlap) or this one."""
        so = self.scheduler.schedule()
        if so.is_empty and self._inflight is not None:
            # All that runs waits for the step in flight (a request that needs its tokens): take it now.
            return self._resolve_inflight() + self._step()
        launched = None
        if not so.is_empty:
            c = self.counters
            c.num_steps += 1
            c.num_rows += len(so.seqs)
            c.num_encodes += len(so.encodes)
            try:
                launched = (so, self.runner.launch(so))
            except TensorParallelError:
                raise                               # the ranks cannot run another step together
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving the rest
                logger.exception("engine step failed")
                return self._resolve_inflight() + self._fail_step(so, f"engine error: {type(e).__name__}: {e}")
            self.scheduler.advance(so)
        outputs = self._resolve_inflight()
        self._inflight = launched
        return outputs if self.overlap else outputs + self._resolve_inflight()

    def _resolve_inflight(self) -> list[RequestOutput]:
        if self._inflight is None:
            return []
        so, pending = self._inflight
        self._inflight = None
        t0 = time.perf_counter()
        try:
            ro = pending.wait()
            self.counters.device_wait_s += time.perf_counter() - t0
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - an asynchronous device error surfaces here
            logger.exception("engine step failed")
            return self._fail_step(so, f"engine error: {type(e).__name__}: {e}")
        finished = self.scheduler.resolve(so, ro)
        return self._process_outputs(so, {r.request_id for r in finished})

    def _process_outputs(self, so: SchedulerOutput, finished: set[str]) -> list[RequestOutput]:
        """Metrics, detokenisation, stop strings and streaming for the requests of a resolved step,
        in O(new tokens): each sequence's detokenizer is fed only the tokens it has not seen."""
        now = time.monotonic()
        outputs, last_rid, live = [], None, self._live
        for scheduled in so.seqs:
            rid = scheduled.request_id
            if rid == last_rid:
                continue                            # a request's sequences are scheduled together
            last_rid = rid
            tracked = live.get(rid)
            if tracked is None:
                continue
            req, m = tracked.request, tracked.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            num_tokens = 0
            for seq in req.seqs:        # resolved output tokens: a placeholder may trail
                ids = seq.token_ids
                num_tokens += len(ids) - (ids[-1] == PLACEHOLDER_TOKEN_ID) - seq.num_hidden_tokens
            if num_tokens > tracked.num_seen_tokens:   # not a step that only fed a prompt token
                tracked.num_seen_tokens = num_tokens
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
            if tracked.detokenizes_per_step:
                for seq, detok in zip(req.seqs, tracked.detoks):
                    end = seq.num_resolved_tokens
                    detok.add(seq.token_ids[seq.num_hidden_tokens + detok.num_tokens:end])
                    if detok.stop_matched is not None and not seq.is_finished:
                        if self.scheduler.finish_seq(seq, RequestStatus.FINISHED_STOPPED, detok.stop_matched):
                            finished.add(rid)
            if rid in finished:
                del live[rid]
                m.finished_time = now
                c = self.counters
                c.num_finished += 1
                c.finish_s += now - m.arrival_time
                if m.first_token_time is not None:
                    c.first_token_s += m.first_token_time - m.arrival_time
                m.num_preemptions = req.num_preemptions
                outputs.append(self._output(tracked, finished=True))
            elif tracked.streaming and req.beam is None:   # beams reorder: final output only
                outputs.append(self._output(tracked, finished=False))
        return outputs

    def _fail_step(self, so: SchedulerOutput, message: str) -> list[RequestOutput]:
        rids = dict.fromkeys([e.request_id for e in so.encodes] + [s.request_id for s in so.seqs])
        return [out for rid in rids if (out := self.abort(rid, message)) is not None]

    def _output(self, tracked: _Tracked, finished: bool) -> RequestOutput | tuple:
        # Every streamed request takes this path every step: plain membership tests, not the
        # status properties.
        if tracked.deltas:
            return self._delta(tracked, finished)
        if tracked.request.beam is not None:
            return self._beam_output(tracked)
        want_logprobs = tracked.params.logprobs is not None
        outs = []
        for seq, detok in zip(tracked.request.seqs, tracked.detoks):
            ids = seq.resolved_output_token_ids    # a copy: the caller may keep it
            status = seq.status
            if finished:
                detok.finish(ids)
                if status in LIVE_STATUSES:        # the request ended before this sequence did
                    status = RequestStatus.FINISHED_ABORTED
            text = detok.text
            if len(text) != detok.num_emitted:     # a stream never shows what a stop string may cut
                text = text[:detok.num_emitted]
            outs.append(CompletionOutput(
                seq.index, text, ids, None if status in LIVE_STATUSES else status.value, seq.stop_reason,
                seq.cumulative_logprob if want_logprobs else None,
                list(seq.logprobs) if seq.logprobs is not None else None, tracked.request.prefix_logprobs))
        return RequestOutput(tracked.request.request_id, tracked.prompt, tracked.prompt_token_ids, outs,
                             finished, tracked.metrics, tracked.error)

    def _delta(self, tracked: _Tracked, finished: bool) -> tuple:
        """What changed since this request's last output, in O(new tokens), as plain tuples (they
        pickle five times faster than named ones, and this is every stream's per-step output):

            (request_id, head, [completion, ...], finished, error, metrics)
            head:       (prompt, prompt_token_ids) in a request's first delta, else None
            completion: (index, new_token_ids, text, text_replaces, finish_reason, stop_reason,
                         cumulative_logprob, new_logprobs, prefix_logprobs)
            metrics:    (arrival_time, first_scheduled_time, first_token_time, finished_time,
                         num_preemptions, new_token_times)

        Token ids and logprobs only grow. The text grows too, except when the final decode of
        the whole output does not extend the streamed pieces: ``text_replaces``, and ``text`` is
        all of it."""
        req, m = tracked.request, tracked.metrics
        first = tracked.sent is None
        if first:
            tracked.sent = [[0, 0, 0] for _ in req.seqs]
        if req.beam is not None:          # beams reorder: their one output is final and whole
            outs = [(c.index, c.token_ids, c.text, False, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                     c.logprobs, c.prefix_logprobs) for c in self._beam_output(tracked).outputs]
        else:
            want_logprobs = tracked.params.logprobs is not None
            outs = []
            for seq, detok, sent in zip(req.seqs, tracked.detoks, tracked.sent):
                hidden, end = seq.num_hidden_tokens, seq.num_resolved_tokens
                new_ids = seq.token_ids[hidden + sent[0]:end]
                status = seq.status
                if finished:
                    detok.finish(seq.token_ids[hidden:end])
                    if status in LIVE_STATUSES:    # the request ended before this sequence did
                        status = RequestStatus.FINISHED_ABORTED
                replaces = detok.rewritten
                text = detok.text if replaces else detok.text[sent[1]:detok.num_emitted]
                lps = seq.logprobs
                new_lps = None if lps is None else lps[sent[2]:]
                sent[0], sent[1], sent[2] = end - hidden, detok.num_emitted, 0 if lps is None else len(lps)
                outs.append((seq.index, new_ids, text, replaces, None if status in LIVE_STATUSES else status.value,
                             seq.stop_reason, seq.cumulative_logprob if want_logprobs else None, new_lps,
                             req.prefix_logprobs))
        times = m.token_times[tracked.num_sent_times:]
        tracked.num_sent_times = len(m.token_times)
        return (req.request_id, (tracked.prompt, tracked.prompt_token_ids) if first else None, outs, finished,
                tracked.error, (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                                m.num_preemptions, times))

    def _beam_output(self, tracked: _Tracked) -> RequestOutput:
        """The n best hypotheses, best first (an aborted search returns its running beams too)."""
        req, params = tracked.request, tracked.params
        hyps: list[Hypothesis] = req.beam.results(req.seqs, RequestStatus.FINISHED_ABORTED)
        tok = self.tokenizer if params.detokenize else None
        outs = []
        for i, h in enumerate(hyps):
            detok = IncrementalDetokenizer(tok, params.skip_special_tokens)
            detok.finish(h.token_ids)
            outs.append(CompletionOutput(index=i, text=detok.text, token_ids=list(h.token_ids),
                                         finish_reason=h.status.finish_reason, stop_reason=h.stop_reason,
                                         cumulative_logprob=h.cumulative_logprob, logprobs=h.logprobs,
                                         prefix_logprobs=req.prefix_logprobs))
        return RequestOutput(req.request_id, tracked.prompt, tracked.prompt_token_ids, outs, True,
                             tracked.metrics, tracked.error)

    def shutdown(self) -> None:
        for rid in list(self._live):
            self.abort(rid, "engine shut down")
        gc.unfreeze()
        runner, self.runner = self.runner, None
        if runner is not None:          # frees the CUDA graphs; tensor parallel also stops its workers
            runner.shutdown()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
