"""The GPU side of a step: builds tensors from a SchedulerOutput, runs encoder and decoder, samples.

The model knows nothing of scheduling; the scheduler knows nothing of tensors. This class
owns the KV cache, the per-request sampling state and the attention metadata.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, KVCache, get_attention_backend
from enc2dec.engine.models.cpu_linear import packed_cpu_linear_available, use_packed_cpu_linear
from enc2dec.engine.core.batch import BeamCandidate, ModelRunnerOutput, ScheduledEncode, ScheduledSeq, SchedulerOutput
from enc2dec.engine.core.block_manager import slot_ids
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.runner.cpu_threads import on_fresh_thread
from enc2dec.engine.runner.cuda_graph import scatter_rows
from enc2dec.engine.runner.fast_linear import set_tile_gemm, skinny_linear_enabled, use_skinny_linear
from enc2dec.engine.runner.fast_norms import use_triton_norms
from enc2dec.engine.runner.host_to_device import to_device
from enc2dec.engine.core.kv_sizing import auto_cpu_kv_budget, kv_bytes_per_token, plan_kv_pools
from enc2dec.engine.runner.loader import load_model
from enc2dec.engine.core.request import PLACEHOLDER_TOKEN_ID
from enc2dec.engine.runner.greedy_head import GreedyHead, greedy_head_available
from enc2dec.engine.runner.sampler import (BeamGroup, DeviceSample, Sampler, SeqSamplingState, all_plain_greedy,
                                           all_simple)
from enc2dec.engine.runner.sampling_ops import stream_key
from enc2dec.kernels import programmatic_launch_on, set_programmatic_launch
from enc2dec.kernels.tile_gemm import configs_file_for

logger = logging.getLogger("enc2dec")

# Per-row fields read with map(): one C-level pass over the batch instead of a Python loop per row.
_SEQ_ID = operator.attrgetter("seq_id")
_INPUTS, _START = operator.attrgetter("input_token_ids"), operator.attrgetter("start_pos")
_BLOCKS, _CROSS = operator.attrgetter("block_ids"), operator.attrgetter("cross_block_ids")
_ENC_LEN = operator.attrgetter("encoder_len")
_NUM_OUT = operator.attrgetter("num_output_tokens")


def encodes_beside(args, device: torch.device, tp: TensorParallelGroup) -> bool:
    """Whether this runner encodes deferred joins on a second stream (``tuning.encoder_beside_decoder``):
    one CUDA GPU only. Tensor-parallel encoders all-reduce, and collectives on two streams of
    one communicator could interleave differently on each rank."""
    return args.tuning.encoder_beside_decoder and device.type == "cuda" and tp.size == 1


@dataclass
class PendingStep:
    """A launched step; ``wait()`` blocks until its sampled tokens are on the host."""

    seq_ids: list[int]
    sample: DeviceSample | None
    event: "torch.cuda.Event | None" = None
    beam_groups: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)   # (request, its rows' seq ids)

    def wait(self) -> ModelRunnerOutput:
        if self.sample is None:
            return ModelRunnerOutput()
        if self.event is not None:
            self.event.synchronize()
        out = self.sample.output()
        beams = {rid: [BeamCandidate(seq_ids[parent], token, score, logprob)
                       for parent, token, score, logprob in cands]
                 for (rid, seq_ids), cands in zip(self.beam_groups, out.beams or [])}
        prefix = {self.seq_ids[row]: lps for row, lps in (out.prefix_logprobs or {}).items()}
        return ModelRunnerOutput(beams=beams, prefix_logprobs=prefix, token_ids=out.token_ids,
                                 logprobs=out.logprobs, top_logprobs=out.top_logprobs)


def _prefix_logprobs(model, seqs: list[ScheduledSeq], states: list[SeqSamplingState], logits: torch.Tensor,
                     hidden: torch.Tensor | None):
    """(row, ids) of the rows whose step feeds their ``prefix_logprob_position`` token, and the
    model's own log-probabilities of those ids after it: [rows, max ids]. That position is the
    step's last input token (its logits row), or an inner one of a prefix fed at once (hidden set)."""
    # logits: [S, vocab]; hidden: [N, d_model] of the step's input tokens, None when a graph ran
    # A sequence reads its prefix before its first output (a recompute after preemption reads it
    # again: the request has the values already); every step checks only that count.
    asked = [(i, list(st.params.prefix_logprob_token_ids)) for i, (s, st) in enumerate(zip(seqs, states))
             if s.num_output_tokens == 0 and st is not None and st.params.prefix_logprob_token_ids
             and s.start_pos <= st.params.prefix_logprob_position < s.seq_len]   # st None: a TP worker
    if not asked:
        return [], None
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new_tokens)
    flat = [starts[i] + states[i].params.prefix_logprob_position - seqs[i].start_pos for i, _ in asked]
    dev = logits.device
    if hidden is not None:      # one extra logits row per asking sequence
        rows = model.compute_logits(hidden.index_select(0, to_device(flat, torch.long, dev)))       # [R, vocab]
    else:                       # a replayed graph feeds one token per sequence: the position is the last
        rows = logits.index_select(0, to_device([i for i, _ in asked], torch.long, dev))
    width = max(len(ids) for _, ids in asked)
    ids = to_device([ids + ids[:1] * (width - len(ids)) for _, ids in asked], torch.long, dev)       # [R, width]
    return asked, rows.float().log_softmax(dim=-1).gather(1, ids)


def _beam_groups(seqs: list[ScheduledSeq], states: list[SeqSamplingState]):
    """Consecutive rows of each beam-search request (the scheduler emits a request's beams together)."""
    groups: list[BeamGroup] = []
    ids: list[tuple[str, list[int]]] = []
    for i, (s, st) in enumerate(zip(seqs, states)):
        if st is None or not st.params.use_beam_search:     # None: a tensor-parallel worker (never samples)
            continue
        if ids and ids[-1][0] == s.request_id and groups[-1].start + groups[-1].num_rows == i:
            groups[-1] = dataclasses.replace(groups[-1], num_rows=groups[-1].num_rows + 1)
            ids[-1][1].append(s.seq_id)
            continue
        num_stop_ids = len(set(st.eos_token_ids) | set(st.stop_token_ids))
        groups.append(BeamGroup(i, 1, max(2, 1 + num_stop_ids) * st.params.beam_width))
        ids.append((s.request_id, [s.seq_id]))
    return groups, ids


# Each field of a packed array starts on a 16-byte boundary, as a fresh allocation would: Triton
# specialises its kernels on pointer alignment, and a field starting mid-line would compile a
# second variant of every kernel that reads it.
_ALIGN_BYTES = 16


def _offsets(itemsize: int, sizes) -> list[int]:
    step, offsets, o = _ALIGN_BYTES // itemsize, [], 0
    for size in sizes:
        offsets.append(o)
        o += -(-size // step) * step
    return offsets + [o]


def _packed(dtype, sizes) -> tuple[np.ndarray, list[np.ndarray]]:
    """One uninitialised array holding fields of ``sizes``, and a view of each field."""
    offsets = _offsets(np.dtype(dtype).itemsize, sizes)
    whole = np.empty(offsets[-1], dtype)
    return whole, [whole[o:o + size] for o, size in zip(offsets, sizes)]


def _device_views(whole: torch.Tensor, sizes) -> list[torch.Tensor]:
    offsets = _offsets(whole.element_size(), sizes)
    return [whole[o:o + size] for o, size in zip(offsets, sizes)]


class ModelRunner:
    """One rank's runner. With tensor parallelism (``tp``) every rank builds one and runs the
    same steps in lockstep; ``tensor_parallel.py`` (driver) and ``tp_worker.py`` add what differs."""

    def __init__(self, args, hf_config, model_path, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, max_input_len: int, feature_extractor=None, tp: TensorParallelGroup = SINGLE):
        build = functools.partial(self._build, args, hf_config, model_path, device, dtype, attn_backend,
                                  max_input_len, feature_extractor, tp)
        if device.type == "cpu" and tp.size == 1:
            on_fresh_thread(build)       # so the engine thread holds the only OpenMP pool (cpu_threads.py)
        else:
            build()

    def _build(self, args, hf_config, model_path, device, dtype, attn_backend, max_input_len, feature_extractor, tp):
        self.args = args
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.is_whisper = hf_config.model_type == "whisper"
        tuning = args.tuning
        if device.type == "cuda":
            set_programmatic_launch(tuning.programmatic_launch)
        self.backend = get_attention_backend(attn_backend, min_keys_per_split=tuning.attn_min_keys_per_split,
                                             last_split_merges=tuning.attn_last_split_merges,
                                             store_in_kernel=tuning.attn_store_in_kernel)
        self.log_mel = None
        if self.is_whisper and feature_extractor is not None:
            from enc2dec.engine.whisper.log_mel import ExtractorLogMel, LogMel

            self.log_mel = LogMel(feature_extractor, device) if device.type == "cuda" else \
                ExtractorLogMel(feature_extractor)
        self.model = load_model(model_path, hf_config, self.backend, dtype, device, args.load_format, tp)
        # The GPU kernels, applied from outside the model (before any graph captures it).
        if device.type == "cuda":
            use_triton_norms(self.model)
        skinny = tuning.skinny_gemm and skinny_linear_enabled(device, self.backend.name)
        # without programmatic launch the tile GEMM is slower than cuBLAS (docs/benchmarks.md, session 37)
        set_tile_gemm(skinny and tuning.tile_gemm and programmatic_launch_on(device),
                      configs_file_for(tuning.tile_gemm_configs,
                                       torch.cuda.get_device_name(device) if device.type == "cuda" else ""),
                      norms=tuning.tile_gemm_norms)
        if skinny:
            use_skinny_linear(self.model, fuse=tuning.fused_gemv)
        # One kernel path per linear: the skinny GEMV's classes (CUDA, or the interpreter when
        # tests ask for it on the CPU) take fused prologues the packed CPU product cannot.
        elif packed_cpu_linear_available(device, dtype):
            use_packed_cpu_linear(self.model)
        self.tokens_per_block = args.kv_cache_config.tokens_per_block
        self.kv_plan = self._plan_kv(self._profile_encoder_activations(max_input_len))
        self.kv = KVCache.allocate(self.model.num_decoder_layers, self.model.num_decoder_heads,
                                   self.model.decoder_head_dim, self.tokens_per_block,
                                   self.kv_plan.num_self_blocks, self.kv_plan.num_cross_blocks, dtype, device,
                                   fp8=args.kv_cache_config.dtype == "fp8",
                                   head_major=getattr(self.backend, "head_major_pools", False),
                                   cross_head_major=True if tuning.cross_kv_head_major and self.backend.name == "triton"
                                   else None)
        self.sampler = Sampler()
        self.greedy_head = GreedyHead(self.model) if device.type == "cpu" and dtype == torch.float32 \
            and tp.size == 1 and tuning.cpu_greedy_head and greedy_head_available() else None
        self.states: dict[str, dict[int, SeqSamplingState]] = {}
        self._state_of: dict[int, SeqSamplingState] = {}  # seq_id -> state, for the seqs _register named
        self._prev_tokens: torch.Tensor | None = None     # last step's samples, on the device
        self._prev_rows: dict[int, int] = {}              # seq_id -> row in _prev_tokens
        # The last step's rows (seq ids) and their (states, all plain greedy, all simple).
        self._rows_ids: list[int] = []
        self._rows: tuple[list[SeqSamplingState], bool, bool] = ([], True, True)
        # Encodes beside the decode steps: every encode runs on this stream, so encoder writes
        # to the cross pool stay in one order; (ticket, event) of deferred joins not yet waited for.
        self.encodes_beside = encodes_beside(args, device, tp)
        self._encode_stream = torch.cuda.Stream(device) if self.encodes_beside and device.type == "cuda" else None
        self._encodes_in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
        self.graphs = self._maybe_capture(attn_backend, max_input_len)
        self.encoder_graphs = self._maybe_capture_encoder(max_input_len)
        self._warm_log_mel(max_input_len)

    def _warm_log_mel(self, max_input_len: int) -> None:
        """Log-mel features of every encoder batch size, once now, on each stream that computes
        them: a batch size first met mid-run (its cuFFT plan, the stream's cached blocks) held a
        decoding step, and every running request, 0.2-0.7 s (docs/benchmarks.md)."""
        if self.log_mel is None or self.device.type != "cuda":
            return
        _, clips = self._largest_encoder_batch(max_input_len)
        streams = [torch.cuda.current_stream(self.device)]
        if self._encode_stream is not None:
            streams.append(self._encode_stream)
        for stream in streams:
            with torch.cuda.stream(stream):
                for b in range(1, clips + 1):     # the steps' own path, pinned host blocks included
                    self._log_mel_of([np.zeros(0, np.float32)] * b)
        torch.cuda.synchronize(self.device)

    def _maybe_capture(self, attn_backend: str, max_input_len: int):
        cfg = self.args.cuda_graph_config
        if cfg is None or self.device.type != "cuda":
            return None
        if self.dtype == torch.float32:
            logger.warning("float32 declines CUDA graph capture; decoder steps run eagerly "
                           "(use dtype=bfloat16 for graphs)")
            return None
        if self.backend.name != "triton":
            logger.warning("CUDA graphs need the triton attention backend (attn_backend=%s); running eagerly",
                           attn_backend)
            return None
        from enc2dec.engine.runner.cuda_graph import DecodeGraphRunner

        sizes = cfg.capture_sizes(self.args.max_batch_size)
        max_dec = self.args.max_seq_len or self.model.max_decoder_positions or 512
        runner = DecodeGraphRunner(self.model, self.kv, self.device, sizes, max_dec, max_input_len,
                                   self.tokens_per_block)
        runner.capture()
        return runner

    def _maybe_capture_encoder(self, max_input_len: int):
        """Encoder graphs per ``encoder_cuda_graph_config`` (default on; None turns them off),
        where decoder graphs run: CUDA, bf16/fp16, triton (docs/architecture.md)."""
        cfg = self.args.encoder_cuda_graph_config
        if cfg is None or self.device.type != "cuda":
            return None
        if self.graphs is None:
            logger.info("no encoder CUDA graphs: they are captured only alongside decoder graphs "
                        "(cuda_graph_config, bf16/fp16, triton); encoder batches run eagerly")
            return None
        from enc2dec.engine.runner.cuda_graph import EncoderGraphRunner, encoder_buckets

        max_len, max_tokens, max_batch = self._encoder_limits(max_input_len)
        buckets = encoder_buckets(cfg, max_batch, max_tokens, max_len, fixed_len=max_len if self.is_whisper else None)
        if not buckets:
            logger.warning("encoder_cuda_graph_config: no (batch, length) bucket fits max_num_tokens=%d; "
                           "encoder batches run eagerly", max_tokens)
            return None
        runner = EncoderGraphRunner(self.model, self.kv, self.device, buckets, self.tokens_per_block,
                                    pad_batch=cfg.enable_padding, whisper_mels=self._whisper_mels, dtype=self.dtype,
                                    capture_stream=self._encode_stream)
        runner.capture()
        return runner

    # ---- start-up -------------------------------------------------------------------------
    def dummy_encoder_batch(self, max_input_len: int):
        """The largest encoder microbatch admission allows, on dummy inputs: ``(inputs, meta)``.
        Every index stays inside the model's tables (a BART position past
        ``max_position_embeddings`` is a device-side assert on the GPU, fatal to the process)."""
        from enc2dec.engine.runner.cuda_graph import uniform_encoder_batch

        length, batch = self._largest_encoder_batch(max_input_len)
        return uniform_encoder_batch(batch, length, self.device, self.dtype, self._whisper_mels)

    def _largest_encoder_batch(self, max_input_len: int) -> tuple[int, int]:
        """(encoder length, requests) of the largest encoder microbatch admission allows."""
        length, tokens, max_batch = self._encoder_limits(max_input_len)
        return length, max(1, min(max_batch, tokens // length))

    def _encoder_limits(self, max_input_len: int) -> tuple[int, int, int]:
        """(longest encoder input inside the model's position table, encoder tokens per step,
        requests encoded per step): what admission allows one encoder microbatch."""
        a = self.args
        length = min(max_input_len, self.model.max_encoder_positions or max_input_len)
        tokens = min(a.encoder_max_num_tokens or a.max_num_tokens, a.max_num_tokens)
        return length, tokens, a.encoder_max_batch_size or a.max_batch_size

    def _profile_encoder_activations(self, max_input_len: int) -> int:
        """Peak bytes the largest admissible encoder microbatch allocates, measured by running
        one on dummy inputs before the KV pools take their share (0 off the GPU, or when the
        run runs out of memory: then the pools are sized from free memory alone, with a
        warning; any other error stops start-up)."""
        if self.device.type != "cuda":
            return 0
        dev = self.device
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            with torch.no_grad():
                inputs, meta = self.dummy_encoder_batch(max_input_len)
                self.model.encode(inputs, meta)
                del inputs, meta
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
        except torch.OutOfMemoryError as e:      # a clean failure; anything else is not caught
            logger.warning("encoder activation profiling ran out of memory (%s); KV pools sized from free "
                           "memory alone", e)
            peak = 0
        torch.cuda.empty_cache()
        logger.info("encoder activations of the largest admissible microbatch: %.2f GiB (kept out of the KV pools)",
                    peak / 2**30)
        return peak

    def _plan_kv(self, activation_bytes: int = 0):
        kvc = self.args.kv_cache_config
        per_token = kv_bytes_per_token(self.model.num_decoder_layers, self.model.num_decoder_heads,
                                       self.model.decoder_head_dim, torch.tensor([], dtype=self.dtype).element_size(),
                                       fp8=kvc.dtype == "fp8")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(max(0, free_bytes - activation_bytes) * kvc.free_gpu_memory_fraction)
        elif kvc.max_cpu_memory_bytes is not None:
            budget = int(kvc.max_cpu_memory_bytes)
        else:
            budget = auto_cpu_kv_budget()
        if kvc.max_tokens is not None:
            budget = min(budget, kvc.max_tokens * per_token)
        budget = self.tp.min_int(budget, self.device)      # every rank the same pools: block ids are shared
        return plan_kv_pools(budget, kvc.cross_kv_cache_fraction, self.tokens_per_block, per_token)

    # ---- per step -------------------------------------------------------------------------
    def launch(self, so: SchedulerOutput) -> "PendingStep":
        """Enqueue a step's GPU work and return before it is done. A sequence whose input is
        the placeholder token (overlap mode) reads its token from the previous step's samples,
        which never leave the GPU for that purpose."""
        for rid in so.finished_request_ids:
            per_seq = self.states.pop(rid, None) or ()
            for seq_id in per_seq:
                self._state_of.pop(seq_id, None)
            self.sampler.release(per_seq)
        if so.block_copies:
            self._copy_blocks(so.block_copies)     # before any attention reads or writes them; never in a graph
        if so.encodes:
            self._register(so.encodes)
            # An encoder cache hit's cross blocks already hold its K/V (core/encoder_cache.py).
            fresh = [e for e in so.encodes if not e.reuses_cross_kv]
            if fresh and self._encode_stream is not None:
                self._encode_beside(fresh, so.encode_ticket)
            elif fresh:
                self._run_encoder(fresh)
        if self._encodes_in_flight and self._encodes_in_flight[0][0] <= so.join_ticket:
            self._wait_for_encodes(so.join_ticket)
        if not so.seqs:
            return PendingStep([], None)
        seq_ids = list(map(_SEQ_ID, so.seqs))
        fill = self._placeholder_sources(so.seqs)
        hidden = None
        if self._can_replay(so):
            logits = self.graphs.run(so.seqs, fill, self._prev_tokens)                               # [S, vocab]
            states, plain, simple = self._step_states(seq_ids, so.seqs)
        else:
            input_ids, positions, meta = self._prepare_decode(so.seqs, fill)
            hidden = self.model.decode(input_ids, positions, meta, self.kv)       # [N, d_model]
            last = hidden[meta.last_token_indices]                                 # [S, d_model]
            states, plain, simple = self._step_states(seq_ids, so.seqs)
            # Rows that want only the argmax of their (masked) logits, on the CPU: found without
            # the float32 head's full read.
            head_ok, mask = False, None
            if self.greedy_head is not None:
                head_ok, mask = (True, None) if plain else \
                    self.sampler.argmax_mask(states, list(map(_NUM_OUT, so.seqs)))
            logits = None if head_ok else self.model.compute_logits(last)
        if logits is None:
            sample, beam_ids = self.sampler.choose(self.greedy_head(last, mask), states), []
        elif plain:         # bare argmax rows: no beams, no prefix log-probs, nothing reads the rows' ids
            sample, beam_ids = self.sampler.sample(logits, states, []), []
        elif simple:        # nor here; drawing rows need only their output counts (a seeded key's position)
            sample, beam_ids = self.sampler.sample(logits, states, list(map(_NUM_OUT, so.seqs))), []
        else:
            groups, beam_ids = _beam_groups(so.seqs, states)
            beam_rows = [s for g in groups for s in so.seqs[g.start:g.start + g.num_rows]]
            sample = self.sampler.sample(logits, states, [s.num_output_tokens for s in so.seqs], groups,
                                         [s.cumulative_logprob for s in beam_rows],
                                         [s.output_token_ids for s in so.seqs], [s.seq_id for s in so.seqs])
            sample.prefix_rows, sample.prefix_vals = _prefix_logprobs(self.model, so.seqs, states, logits, hidden)
        self._prev_tokens = sample.token_ids                                       # [S] stays on device
        self._prev_rows = dict(zip(seq_ids, range(len(seq_ids))))
        event = None
        if self.device.type == "cuda":
            sample = sample.to_host(non_blocking=True)
            # torch.Event finds the current stream in C++; torch.cuda.Event.record() asks Python's
            # torch.cuda.current_stream(), a few microseconds of the engine thread's GIL a step.
            event = torch.Event(device=self.device)
            event.record()
        return PendingStep(seq_ids, sample, event, beam_ids)

    def _encode_beside(self, encodes: list[ScheduledEncode], ticket: int) -> None:
        """Encode on the second stream. With a ticket, nothing in this step reads the result: the
        requests join in a later step, which waits for it (``_wait_for_encodes``); without, this
        step decodes them and its decode waits for the encoder now. Waits are on the GPU only."""
        main, side = torch.cuda.current_stream(self.device), self._encode_stream
        if self.encoder_graphs is None or self.encoder_graphs.pick(encodes) is None:
            # Eager encodes stay on the main stream (after whatever the encoder stream still
            # writes): on the second stream their activations would come from that stream's own
            # allocator pool, which the main stream's cached blocks cannot serve.
            main.wait_stream(side)
            self._run_encoder(encodes)
            return
        # The step in flight may still read cross blocks freed since (a request that just
        # finished or was preempted) that this encode now writes.
        side.wait_stream(main)
        with torch.cuda.stream(side):      # inputs and activations are allocated on, and freed to, side
            self._run_encoder(encodes)
        if ticket:
            event = torch.cuda.Event()
            event.record(side)
            self._encodes_in_flight.append((ticket, event))
        else:
            main.wait_stream(side)

    def _wait_for_encodes(self, ticket: int) -> None:
        """The main stream waits for the encodes up to ``ticket`` (one stream: the last is enough)."""
        queue, last = self._encodes_in_flight, None
        while queue and queue[0][0] <= ticket:
            last = queue.popleft()[1]
        if last is not None:
            torch.cuda.current_stream(self.device).wait_event(last)

    def _can_replay(self, so: SchedulerOutput) -> bool:
        """Whether this step's decoder half replays a graph; a step that also encodes new
        requests (a mixed step) only with ``enable_encoder_decoder_mixed_cuda_graph``."""
        if self.graphs is None or (so.encodes and not self.args.enable_encoder_decoder_mixed_cuda_graph):
            return False
        return self.graphs.can_run(so.seqs)

    def shutdown(self) -> None:
        """Free the CUDA graphs (and their memory pools) now rather than at garbage collection."""
        for name in ("graphs", "encoder_graphs"):
            graphs = getattr(self, name, None)
            setattr(self, name, None)
            if graphs is not None:
                graphs.release()

    def _step_states(self, seq_ids: list[int], seqs: list[ScheduledSeq]):
        """The rows' sampling states, whether all are plain greedy and whether all are simple
        (``sampler.all_simple``): worked out when the rows change, else the last step's (a
        sequence keeps its state while it lives, and seq ids are never reused)."""
        if seq_ids == self._rows_ids:
            return self._rows
        states = list(map(self._state_of.get, seq_ids))
        if not all(states):         # forked beams share their request's state; a TP worker has none
            states = [st if st is not None else self._sampling_state(s) for st, s in zip(states, seqs)]
        self._rows_ids, self._rows = seq_ids, (states, all_plain_greedy(states), all_simple(states))
        return self._rows

    def _sampling_state(self, s: ScheduledSeq) -> SeqSamplingState:
        per_seq = self.states[s.request_id]
        # Beams forked since admission share their request's state (beam search keeps no RNG).
        return per_seq.get(s.seq_id) or next(iter(per_seq.values()))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src, dst = to_device(copies, torch.long, self.device).t()            # one copy: [2, n]
        for layer in self.kv.self_kv:
            for t in layer.tensors():                          # [num_blocks, tokens_per_block, ...]
                rows = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t   # no float8 index_copy_
                rows.index_copy_(0, dst, rows.index_select(0, src))

    def _placeholder_sources(self, seqs: list[ScheduledSeq]):
        """The placeholder inputs as [flat token indices, rows of the previous step's samples]
        (two lists, one copy to the device), or None when no input is a placeholder."""
        dst, src, offset, prev_rows = [], [], -1, self._prev_rows
        for s in seqs:
            ids = s.input_token_ids
            offset += len(ids)
            if ids[-1] == PLACEHOLDER_TOKEN_ID:
                dst.append(offset)
                src.append(prev_rows[s.seq_id])
        return [dst, src] if dst else None

    def _register(self, encodes: list[ScheduledEncode]) -> None:
        for enc in encodes:
            if enc.request_id in self.states:      # resumed after preemption: keep its state
                continue
            spec: SeqSamplingState = enc.sampling_params
            seeded = spec.params.seed is not None and not spec.params.is_greedy
            per_seq = self.states[enc.request_id] = {
                seq_id: dataclasses.replace(spec, stream=stream_key(spec.params.seed, index) if seeded else None)
                for seq_id, index in zip(enc.seq_ids, enc.seq_indices)}
            self._state_of.update(per_seq)

    def _run_encoder(self, encodes: list[ScheduledEncode]) -> None:
        bucket = self.encoder_graphs.pick(encodes) if self.encoder_graphs is not None else None
        if bucket is not None:
            features = self._whisper_features(encodes) if self.is_whisper else None
            self.encoder_graphs.run(encodes, bucket, features)
            return
        dev, tpb = self.device, self.tokens_per_block
        lens = [e.encoder_len for e in encodes]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slots = []
        for e in encodes:
            slots += slot_ids(e.cross_block_ids, 0, e.encoder_len, tpb)
        positions = None
        if self.is_whisper:
            inputs = self._whisper_features(encodes)
        else:
            flat = [t for e in encodes for t in e.encoder_input]
            inputs = to_device(flat, torch.long, dev)
            positions = to_device([p for n in lens for p in range(n)], torch.long, dev)
        meta = EncoderMetadata(
            cu_seqlens=to_device(cu, torch.int32, dev), seq_lens=lens, positions=positions,
            cross_slot_mapping=to_device(slots, torch.long, dev))
        enc_hidden = self.model.encode(inputs, meta)                # [num_enc_tokens, d_model]
        self.model.write_cross_kv(enc_hidden, meta, self.kv)

    @property
    def _whisper_mels(self) -> int | None:
        """Log-mel bins of a Whisper encoder's input; None for text encoders."""
        return self.model.config.num_mel_bins if self.is_whisper else None

    def _whisper_features(self, encodes: list[ScheduledEncode]) -> torch.Tensor:
        inputs = [e.encoder_input for e in encodes]
        if inputs[0].ndim == 1:                     # raw waves of up to 30 s: features on the device
            return self._log_mel_of(inputs).to(self.dtype)                         # [B, n_mels, 3000]
        return torch.stack([to_device(x, None, self.device) for x in inputs]).to(self.dtype)

    def _log_mel_of(self, waves: list[np.ndarray]) -> torch.Tensor:
        """Log-mel features of raw waves: each copied once, padded, into one batch (page-locked on
        CUDA) sent in one copy; a 30 s wave is 1.9 MB, and this runs on the engine thread."""
        batch = self.log_mel.batch(waves, pin=self.device.type == "cuda")             # [B, n_samples]
        return self.log_mel(batch.to(self.device, non_blocking=True))                # [B, n_mels, 3000]

    def _prepare_decode(self, seqs: list[ScheduledSeq], fill: list[list[int]] | None = None):
        # Per sequence, one map() per field read; the rest is numpy (no list per row: at 256 rows
        # those lists set off a garbage collection every step). The int64 and the int32 fields
        # each travel as one array, viewed in parts on the device: two copies, not nine.
        dev, tpb, n = self.device, self.tokens_per_block, len(seqs)
        lens = np.fromiter(map(len, map(_INPUTS, seqs)), np.int64, n)
        starts = np.fromiter(map(_START, seqs), np.int64, n)
        ends = np.cumsum(lens)
        total = int(ends[-1])
        blocks, cross = list(map(_BLOCKS, seqs)), list(map(_CROSS, seqs))
        width, cross_width = max(1, max(map(len, blocks))), max(1, max(map(len, cross)))
        k = len(fill[0]) if fill is not None else 0
        a64, (ids, pos, slots, last, fill_dst, fill_src) = _packed(np.int64, (total, total, total, n, k, k))
        a32, (qsl, seq_lens, enc_lens, table, cross_table) = _packed(
            np.int32, (n + 1, n, n, n * width, n * cross_width))
        ids[:] = np.fromiter(itertools.chain.from_iterable(map(_INPUTS, seqs)), np.int64, total)
        if total == n:                                           # every sequence feeds one token
            row, pos[:] = np.arange(n), starts
        else:
            row = np.repeat(np.arange(n), lens)                  # each new token's sequence
            pos[:] = starts[row] + np.arange(total) - (ends - lens)[row]
        qsl[0], qsl[1:] = 0, ends
        last[:] = ends - 1
        seq_lens[:] = starts + lens
        enc_lens[:] = np.fromiter(map(_ENC_LEN, seqs), np.int64, n)
        table, cross_table = table.reshape(n, width), cross_table.reshape(n, cross_width)
        table[:] = 0
        cross_table[:] = 0
        scatter_rows(table, blocks)
        scatter_rows(cross_table, cross)
        slots[:] = table[row, pos // tpb].astype(np.int64) * tpb + pos % tpb
        if k:
            fill_dst[:], fill_src[:] = fill
        d64, d32 = to_device(a64, torch.long, dev), to_device(a32, torch.int32, dev)
        view64, view32 = _device_views(d64, (total, total, total, n, k, k)), \
            _device_views(d32, (n + 1, n, n, n * width, n * cross_width))
        input_ids, positions = view64[0], view64[1]
        meta = DecoderMetadata(
            query_start_loc=view32[0], seq_lens=view32[1], block_tables=view32[3].view(n, width),
            slot_mapping=view64[2], cross_block_tables=view32[4].view(n, cross_width), enc_lens=view32[2],
            query_lens_host=lens.tolist(), seq_lens_host=seq_lens.tolist(), enc_lens_host=enc_lens.tolist(),
            last_token_indices=view64[3])
        if k:           # placeholder inputs: the previous step's samples, by rows that came in the same copy
            input_ids[view64[4]] = self._prev_tokens[view64[5]]
        return input_ids, positions, meta
