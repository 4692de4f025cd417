"""Continuous-batching policy: which requests to encode, which sequences to decode.

Pure Python (no torch). A step is ``schedule()`` -> model runner -> ``advance()`` ->
``resolve()``: ``advance`` accounts the launched step's tokens (``num_computed_tokens``, and
a placeholder for each sampled token), ``resolve`` writes the sampled tokens once they arrive
and applies the stop rules. ``update()`` is the two at once, for a step that is waited on.

With the overlap scheduler the engine resolves step N only after launching N+1: N+1 was
scheduled from N's placeholders, and the runner takes N's sampled ids from the GPU. A
sequence that stopped at N may already be in step N+1: its extra token is dropped, never
returned. A request that needs its tokens on the host (``Request.needs_host_tokens``: beam
search, Python logits processors that read ids) gets no placeholder: it is simply not
scheduled while its step is in flight, keeping its batch rows and growth room, so it runs
every other step while the requests around it keep the overlap.

Policy, in the order ``schedule()`` applies it:
1. Running requests, oldest admission first: every live sequence gets self blocks for
   all its tokens. When the pool is short, the most recently admitted request is
   preempted (recompute: all its KV is dropped, it goes back to the front of the waiting
   queue and is re-encoded and re-fed its whole token history when readmitted).
2. Unless step 1 preempted, waiting requests are admitted strictly first come, first
   served: the first one that does not fit ends admission (no overtaking), so a large
   request is never starved by small ones behind it. A request whose
   ``encoder_cache_key`` names cross blocks kept from a finished request shares them and is
   not encoded (``encoder_cache.py``); kept blocks give way to any request that needs room.
   With ``defer_joins_while_decoding`` (k), a request encoded while others decode does not decode
   in that step: the runner encodes it beside the next k decode steps, and it joins the batch
   k schedule() calls later, in a step whose ``join_ticket`` tells the runner to wait (on the
   GPU) for that encoder. A fixed k, not "once the encoder is seen done", keeps the batches,
   and so the outputs, the same from run to run.

Beam search: a request starts with one sequence and runs up to ``best_of`` beams, all of
which admission reserves (batch rows and headroom). After each step ``BeamState`` picks the
surviving (parent, token) pairs; a parent chosen twice is forked, its blocks shared by
reference count, and a beam about to write into a shared, partly filled block gets its
own copy at the next ``schedule()`` (copy-on-write; the copies ride in
``SchedulerOutput.block_copies``). That half lives in ``beam_scheduling.py``.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from enc2dec.engine.core.admission import SchedulerLimits, admission_error  # noqa: F401 (re-export)
from enc2dec.engine.core.batch import ModelRunnerOutput, ScheduledEncode, ScheduledSeq, SchedulerOutput
from enc2dec.engine.core.beam_scheduling import BeamScheduling
from enc2dec.engine.core.block_manager import BlockPool, blocks_needed
from enc2dec.engine.core.encoder_cache import DEFAULT_MAX_ENTRIES, EncoderCache
from enc2dec.engine.core.request import LIVE_STATUSES, PLACEHOLDER_TOKEN_ID, Request, RequestStatus, Sequence
from enc2dec.engine.core.stop_rules import check_stop


_RUNNING = RequestStatus.RUNNING


def _schedulable(req: Request) -> list[Sequence]:
    """Live sequences that may take another step (not waiting for a resolve to end them).
    Read-only: it may be ``req.seqs`` itself."""
    seqs, max_output = req.seqs, req.max_output_tokens
    if len(seqs) == 1:              # most requests: no list to build
        s = seqs[0]
        return seqs if s.status in LIVE_STATUSES and len(s.token_ids) - s.num_hidden_tokens < max_output else []
    return [s for s in seqs if s.status in LIVE_STATUSES and len(s.token_ids) - s.num_hidden_tokens < max_output]


@dataclass
class _StepBudget:
    """What the step being built uses so far."""

    num_encodes: int = 0
    num_encoder_tokens: int = 0
    num_tokens: int = 0          # encoder positions + decoder tokens
    num_seqs: int = 0            # live sequences of running requests
    num_growth_blocks: int = 0   # self blocks those sequences need on top at the next step
    longest_encode: int = 0      # encoder positions of the longest input encoded this step


class Scheduler(BeamScheduling):
    def __init__(self, limits: SchedulerLimits, num_self_blocks: int, num_cross_blocks: int,
                 max_cached_encodes: int = DEFAULT_MAX_ENTRIES) -> None:
        self.limits = limits
        self.self_pool = BlockPool(num_self_blocks)
        self.cross_pool = BlockPool(num_cross_blocks)
        self.encoder_cache = EncoderCache(self.cross_pool, max_cached_encodes)
        self.waiting: deque[Request] = deque()   # FCFS; preempted requests return to the front
        self.running: list[Request] = []         # admission order; preemption takes the last
        self.num_preemptions = 0                 # since start, for metrics
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._live_seqs: dict[int, tuple[Request, Sequence]] = {}   # unfinished seqs by seq_id
        self._finished_ids: list[str] = []       # finished or aborted since the last schedule()
        self._num_schedules = 0                  # schedule() calls: an encode's ticket is its call's number
        self._joined_ticket = 0                  # the last ticket whose requests joined
        self._pending_joins: deque[tuple[int, list[Request]]] = deque()   # (ticket, requests), in order
        # (count, longest) -> the encoder positions of the captured CUDA graph that would run that
        # microbatch (padded), or None when none holds it; set by the engine when encoder graphs
        # pad batches (None: every microbatch runs as packed, eagerly).
        self.encoder_graph_positions: Callable[[int, int], int | None] | None = None

    # ----------------------------------------------------------------- requests in and out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(req.live_seqs) for req in self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _join_encoded(self) -> None:
        """Requests whose encode was k schedule() calls ago join this step. A request preempted
        and admitted again since waits for its new ticket instead."""
        pending, due = self._pending_joins, self._num_schedules - self.limits.defer_joins_while_decoding
        while pending and pending[0][0] <= due:
            ticket, reqs = pending.popleft()
            self._joined_ticket = ticket
            for req in reqs:
                if req.encode_pending == ticket:
                    req.encode_pending = 0

    def check_admissible(self, req: Request) -> str | None:
        """Why ``req`` can never be scheduled with these limits and pools; None if it can."""
        return admission_error(req, self.limits, self.self_pool.num_total_blocks,
                               self.cross_pool.num_total_blocks)

    def add_request(self, req: Request) -> None:
        """Queue ``req``; raises ValueError for a duplicate id or an inadmissible request."""
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        reason = self.check_admissible(req)
        if reason is not None:
            raise ValueError(reason)
        assert req.status is RequestStatus.WAITING and not req.cross_block_ids, req
        self._requests[req.request_id] = req
        for seq in req.live_seqs:
            assert not seq.block_ids and seq.num_computed_tokens == 0, seq
            self._live_seqs[seq.seq_id] = (req, seq)
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort in any state; its id is reported at the next schedule(). None if unknown or done."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for seq in req.live_seqs:
            self._finish(req, seq, RequestStatus.FINISHED_ABORTED, None)
        return req

    def finish_seq(self, seq: Sequence | int, status: RequestStatus,
                   stop_reason: int | str | None = None) -> Request | None:
        """Finish one sequence (e.g. a stop string matched); returns its request if that finished too."""
        assert status.is_finished, status
        seq_id = seq if isinstance(seq, int) else seq.seq_id
        entry = self._live_seqs.get(seq_id)
        if entry is None:
            return None   # already finished or aborted
        return self._finish(*entry, status, stop_reason)

    # ------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _StepBudget()
        self._num_schedules += 1
        if self._pending_joins:
            self._join_encoded()
        # Every step carries it: the runner waits once per ticket, whichever step comes first.
        out.join_ticket = self._joined_ticket
        self._schedule_running(out, budget)
        # After a preemption the preempted request heads the queue and cannot fit yet, so
        # FCFS admits nothing anyway; saying so keeps admission from eating freed blocks.
        if not out.preempted_request_ids:
            self._admit_waiting(out, budget)
        # Finished ids ride on the next step the runner actually executes: an engine may
        # skip empty outputs, and the runner must still hear of them to drop their state.
        if not out.is_empty:
            out.finished_request_ids, self._finished_ids = self._finished_ids, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        running, emitted = self.running, out.seqs
        tpb, one_prompt_token = self.limits.tokens_per_block, self.limits.feed_prompt_one_token_per_step
        num_fed = num_growth = num_plain = 0
        i = 0
        while i < len(running):
            req = running[i]
            i += 1
            seqs = req.seqs
            if (len(seqs) == 1 and req.beam is None and not req.has_step_in_flight and not req.encode_pending
                    and not req.needs_host_tokens):
                # The common request (one sequence, no beams, nothing paused, no host tokens), which
                # every step meets once per running request: _emit_seqs inlined, and its
                # accounting summed once after the loop. A sequence crossing into a new block
                # takes the general path below.
                seq = seqs[0]
                token_ids, hidden, max_output = seq.token_ids, seq.num_hidden_tokens, req.max_output_tokens
                num_tokens = len(token_ids)
                if seq.status not in LIVE_STATUSES or num_tokens - hidden >= max_output:
                    continue        # nothing to schedule: it ends at the next resolve
                if len(seq.block_ids) * tpb >= num_tokens:
                    start = seq.num_computed_tokens
                    end = start + 1 if one_prompt_token and start < hidden else num_tokens
                    emitted.append(ScheduledSeq(seq.seq_id, req.request_id, token_ids[start:end], start,
                                                seq.block_ids, req.cross_block_ids, req.encoder_len,
                                                num_tokens - hidden, seq.cumulative_logprob))
                    num_fed += end - start
                    num_plain += 1
                    num_growth += num_tokens % tpb == 0 and num_tokens - hidden + 1 < max_output
                    continue
            seqs = _schedulable(req)
            if req.has_step_in_flight or req.encode_pending:
                # Paused until resolve() brings its tokens, or until its encoder has run.
                self._reserve(req, seqs, budget)
            # Beams grow (and copy shared blocks) first; other requests only when they cross a block.
            elif (req.beam is not None and not self._grow_self_blocks(req, seqs, out)
                  or not self._emit_seqs(req, seqs, out, budget)):
                break   # req was the newest running request and preempted itself
        budget.num_tokens += num_fed
        budget.num_seqs += num_plain
        budget.num_growth_blocks += num_growth
        # Running sequences feed one token each, and admission kept their count within budget.
        assert budget.num_tokens <= self.limits.max_num_tokens, "was update() skipped?"

    def _grow_self_blocks(self, req: Request, seqs: list[Sequence], out: SchedulerOutput) -> bool:
        """Cover the tokens of ``seqs`` (req's schedulable sequences), preempting newer requests;
        False if req itself went."""
        tpb = self.limits.tokens_per_block
        # Only beams share blocks, so only they can need copies before writing.
        num_copies = self._num_copy_on_write_blocks(seqs) if req.beam is not None else 0
        missing = [(len(s.token_ids) + tpb - 1) // tpb - len(s.block_ids) for s in seqs]
        num_needed = sum(missing) + num_copies
        if not num_needed:
            return True             # the common decode step: every sequence fits its blocks
        while not self.self_pool.can_allocate(num_needed):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is req:
                return False
        for seq, num_missing in zip(seqs, missing):
            if num_copies:
                self._copy_on_write(seq, out)
            if num_missing:         # a new list: a ScheduledSeq of an earlier step may hold the old one
                seq.block_ids = seq.block_ids + self.self_pool.allocate(num_missing)
        return True

    def _preempt(self, req: Request) -> None:
        assert self.running[-1] is req, "only the newest running request is preempted"
        self.running.pop()
        for seq in req.live_seqs:
            self.self_pool.free(seq.block_ids)
            seq.block_ids = []
            seq.num_computed_tokens = 0   # generated tokens stay: they are re-fed on resume
            seq.status = RequestStatus.WAITING
        self.cross_pool.free(req.cross_block_ids)
        req.cross_block_ids = []
        req.status = RequestStatus.WAITING
        req.has_step_in_flight = False   # its step in flight is dropped: resolve() skips it
        req.encode_pending = 0           # its encode in flight is dropped too: readmission encodes again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        # Bound the encoder work of a step that running sequences also wait on (their ITL).
        cap = self._encoder_cap(budget.num_seqs)
        # Sequences decode this step: new requests join once their encoder has run beside them.
        ticket = self._num_schedules if self.limits.defer_joins_while_decoding and budget.num_seqs else 0
        deferred = []
        while self.waiting:
            req = self.waiting[0]
            is_cached = req.encoder_cache_key in self.encoder_cache
            if not self._can_admit(req, budget, is_cached):
                break
            if not is_cached and budget.num_encodes and self._ends_encoder_microbatch(req, budget, cap):
                break
            self._admit(self.waiting.popleft(), out, budget, is_cached, 0 if is_cached else ticket)
            if req.encode_pending:
                deferred.append(req)
        if deferred:
            out.encode_ticket = ticket
            self._pending_joins.append((ticket, deferred))

    def _encoder_cap(self, num_decoding: int) -> int:
        """Encoder positions a step that decodes ``num_decoding`` sequences may encode (0: no
        bound but the step's own limits)."""
        if not num_decoding:
            return 0
        lim = self.limits
        caps = [c for c in (lim.encoder_max_num_tokens_while_decoding,
                            lim.encoder_max_num_tokens_per_decoding_row * num_decoding) if c]
        return min(caps, default=0)

    def _ends_encoder_microbatch(self, req: Request, budget: _StepBudget, cap: int) -> bool:
        """Whether ``req`` should wait for a later step rather than join this step's encoder
        microbatch (which holds at least one request): it would exceed ``cap`` (0: none), the
        encoder positions a decoding step may run, or take the microbatch out of every captured
        encoder graph. A microbatch no graph holds runs eagerly on the main stream, launch by
        launch, where a graph replays beside the decoder: bart-large-cnn's 21 requests of 384
        positions (8,064 of the 8,192-token budget; the largest graph at that length holds 16)
        took ~15 ms of host time a step while every running sequence waited (docs/benchmarks.md,
        sessions 30-31). With graphs, ``cap`` counts the positions the graph runs, padding
        included: 10 requests of 384 replay the 16 x 512 graph, as costly as 16."""
        positions = self.encoder_graph_positions
        now = positions(budget.num_encodes, budget.longest_encode) if positions is not None else None
        if now is None:          # no graphs, or an eager microbatch already: packed positions
            return bool(cap) and budget.num_encoder_tokens + req.encoder_len > cap
        after = positions(budget.num_encodes + 1, max(budget.longest_encode, req.encoder_len))
        return after is None or bool(cap) and after > cap

    def _can_admit(self, req: Request, budget: _StepBudget, is_cached: bool = False) -> bool:
        """Whether ``req`` fits this step; ``is_cached``: its cross blocks are in the encoder cache
        (no encoder work, no new cross blocks)."""
        lim, tpb = self.limits, self.limits.tokens_per_block
        seqs = _schedulable(req)
        num_encoder_tokens = 0 if is_cached else req.encoder_len
        num_step_tokens = num_encoder_tokens + sum(s.num_new_tokens for s in seqs)
        num_self_blocks = sum(blocks_needed(s.num_tokens, tpb) + self._num_growth_blocks(req, s)
                              for s in seqs) + self._num_unexpanded_beams(req, seqs)
        return ((is_cached or budget.num_encodes + 1 <= lim.encoder_max_batch_size
                 and budget.num_encoder_tokens + num_encoder_tokens <= lim.encoder_max_num_tokens)
                and budget.num_seqs + len(seqs) + self._num_unexpanded_beams(req, seqs) <= lim.max_batch_size
                and budget.num_tokens + num_step_tokens <= lim.max_num_tokens
                and (is_cached or self._can_allocate_cross(blocks_needed(req.encoder_len, tpb)))
                # Leave room for every running sequence to grow next step, so a request is
                # not encoded now only to be preempted at the next block boundary.
                and self.self_pool.can_allocate(num_self_blocks + budget.num_growth_blocks))

    def _can_allocate_cross(self, num_blocks: int) -> bool:
        """Free cross blocks, counting those only the encoder cache holds (evicted on allocation)."""
        pool = self.cross_pool
        return pool.can_allocate(num_blocks) or bool(self.encoder_cache) and \
            pool.num_free_blocks + self.encoder_cache.num_evictable_blocks() >= num_blocks

    def _admit(self, req: Request, out: SchedulerOutput, budget: _StepBudget, is_cached: bool = False,
               ticket: int = 0) -> None:
        """Allocate ``req``'s blocks, schedule its encode and, unless ``ticket`` defers its join,
        its sequences."""
        tpb = self.limits.tokens_per_block
        if is_cached:
            req.cross_block_ids = self.encoder_cache.share(req.encoder_cache_key)
        else:
            num_cross = blocks_needed(req.encoder_len, tpb)
            self.encoder_cache.make_room(num_cross)
            req.cross_block_ids = self.cross_pool.allocate(num_cross, prefer_run=True)
        seqs = req.live_seqs
        for seq in seqs:
            seq.block_ids = self.self_pool.allocate(blocks_needed(seq.num_tokens, tpb))
            seq.status = RequestStatus.RUNNING
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.encodes.append(ScheduledEncode(
            request_id=req.request_id, encoder_input=req.encoder_input,
            encoder_len=req.encoder_len, cross_block_ids=req.cross_block_ids,
            sampling_params=req.sampling_params, seq_ids=[s.seq_id for s in seqs],
            seq_indices=[s.index for s in seqs], reuses_cross_kv=is_cached))
        if not is_cached:
            budget.num_encodes += 1
            budget.num_encoder_tokens += req.encoder_len
            budget.num_tokens += req.encoder_len
            budget.longest_encode = max(budget.longest_encode, req.encoder_len)
        if ticket:
            req.encode_pending = ticket
            self._reserve(req, _schedulable(req), budget)
        else:
            self._emit_seqs(req, _schedulable(req), out, budget)

    def _emit_seqs(self, req: Request, seqs: list[Sequence], out: SchedulerOutput, budget: _StepBudget) -> bool:
        """Schedule ``seqs`` (req's schedulable sequences), first growing their block tables where
        they need it; False if that preempted req itself (then nothing is scheduled)."""
        one_prompt_token = self.limits.feed_prompt_one_token_per_step
        tpb, max_output = self.limits.tokens_per_block, req.max_output_tokens
        rid, cross_ids, encoder_len = req.request_id, req.cross_block_ids, req.encoder_len
        host_ids = req.needs_host_tokens and (req.beam is None or req.beam.needs_token_ids)
        num_tokens_fed = num_growth = 0
        needs_blocks = False
        batch = []
        for seq in seqs:
            start, token_ids, hidden = seq.num_computed_tokens, seq.token_ids, seq.num_hidden_tokens
            num_tokens = len(token_ids)
            end = start + 1 if one_prompt_token and start < hidden else num_tokens
            # Neither list is copied: both are replaced, never mutated, while the request lives.
            scheduled = ScheduledSeq(seq.seq_id, rid, token_ids[start:end], start, seq.block_ids, cross_ids,
                                     encoder_len, num_tokens - hidden, seq.cumulative_logprob)
            if host_ids:
                assert token_ids[-1] != PLACEHOLDER_TOKEN_ID, f"seq {seq.seq_id}: its last token is not sampled yet"
                scheduled.output_token_ids = token_ids[hidden:]
            batch.append(scheduled)
            needs_blocks = needs_blocks or len(seq.block_ids) * tpb < num_tokens
            num_tokens_fed += end - start
            # The next step needs one more block at a boundary, unless this step is its last.
            num_growth += num_tokens % tpb == 0 and num_tokens - hidden + 1 < max_output
        if needs_blocks:            # one step in tokens_per_block: this one crosses into a new block
            if not self._grow_self_blocks(req, seqs, out):
                return False
            for seq, scheduled in zip(seqs, batch):
                scheduled.block_ids = seq.block_ids
        out.seqs += batch
        budget.num_tokens += num_tokens_fed
        budget.num_seqs += len(seqs)
        budget.num_growth_blocks += num_growth
        if req.beam is not None:
            self._reserve_unexpanded_beams(req, seqs, budget)
        return True

    def _reserve(self, req: Request, seqs: list[Sequence], budget: _StepBudget) -> None:
        """Keep a paused request's rows and the blocks its next step needs out of admission's reach:
        resolve() appends one token to each sequence, so the growth is counted as if it ran now."""
        tpb, max_output = self.limits.tokens_per_block, req.max_output_tokens
        budget.num_seqs += len(seqs)
        budget.num_growth_blocks += sum(s.num_tokens % tpb == 0 and s.num_output_tokens + 1 < max_output
                                        for s in seqs)
        if req.beam is not None:
            self._reserve_unexpanded_beams(req, seqs, budget)

    def _reserve_unexpanded_beams(self, req: Request, seqs: list[Sequence], budget: _StepBudget) -> None:
        # Beams not forked yet: their rows (and a private last block each) are reserved now,
        # so expanding never overflows max_batch_size nor preempts at once.
        num_unexpanded = self._num_unexpanded_beams(req, seqs)
        budget.num_seqs += num_unexpanded
        budget.num_growth_blocks += num_unexpanded

    def _num_growth_blocks(self, req: Request, seq: Sequence) -> int:
        """Extra self blocks ``seq`` needs next step: 1 at a block boundary unless it ends now."""
        is_last_step = seq.num_output_tokens + 1 >= req.max_output_tokens
        is_at_boundary = seq.num_tokens % self.limits.tokens_per_block == 0
        return int(is_at_boundary and not is_last_step)

    # ------------------------------------------------------------------- advance / resolve

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """A step waited on: ``advance`` and ``resolve`` at once; returns requests finished now."""
        self.advance(sched_out)
        return self.resolve(sched_out, runner_out)

    def advance(self, sched_out: SchedulerOutput) -> None:
        """Step ``sched_out`` is launched: its tokens are computed, and each sampled token gets a
        placeholder until resolve(), except in requests that pause instead (needs_host_tokens)."""
        live = self._live_seqs
        for scheduled in sched_out.seqs:
            entry = live.get(scheduled.seq_id)
            if entry is None:
                continue   # finished or aborted since schedule()
            req, seq = entry
            # Only advance() moves a sequence on and only schedule() preempts, so a live sequence is
            # exactly as schedule() left it, unless schedule() ran twice for one advance().
            assert seq.num_computed_tokens == scheduled.start_pos and seq.status is _RUNNING, \
                f"seq {seq.seq_id} changed since it was scheduled: schedule() ran twice before advance()?"
            seq_len = scheduled.start_pos + len(scheduled.input_token_ids)
            seq.num_computed_tokens = seq_len
            if req.needs_host_tokens:
                req.has_step_in_flight = True
            elif seq_len == len(seq.token_ids):    # else an inner prompt token: no output
                seq.token_ids.append(PLACEHOLDER_TOKEN_ID)

    def resolve(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Write advanced step ``sched_out``'s sampled tokens and apply the stop rules; returns
        requests finished now."""
        finished: list[Request] = []
        beam_reqs: dict[str, Request] = {}
        live = self._live_seqs
        by_row, row_logprobs, row_tops = runner_out.token_ids, runner_out.logprobs, runner_out.top_logprobs
        for seq_id, lps in runner_out.prefix_logprobs.items():
            if seq_id in live:
                live[seq_id][0].prefix_logprobs = lps
        for row, scheduled in enumerate(sched_out.seqs):
            entry = live.get(scheduled.seq_id)
            if entry is None:
                continue   # stopped at an earlier step, aborted, or finished meanwhile
            req, seq = entry
            token_ids = seq.token_ids
            index = scheduled.start_pos + len(scheduled.input_token_ids)   # where the sampled token goes
            if req.needs_host_tokens:
                req.has_step_in_flight = False
                # A preempted request drops the step (it is recomputed); an inner prompt token has no output.
                if seq.status is not _RUNNING or seq.num_computed_tokens != index or index != len(token_ids):
                    continue
                if req.beam is not None:
                    beam_reqs[req.request_id] = req   # all its beams step together below
                    continue
                token_ids.append(PLACEHOLDER_TOKEN_ID)
            elif index >= len(token_ids) or token_ids[index] != PLACEHOLDER_TOKEN_ID:
                continue   # an inner prompt token
            assert row < len(by_row), f"runner returned no token for seq {scheduled.seq_id}"
            token_id = by_row[row]
            logprob = row_logprobs[row] if row_logprobs is not None else 0.0
            top = row_tops[row] if row_tops is not None else None
            token_ids[index] = token_id
            seq.cumulative_logprob += logprob
            if top is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(top)
            if (index + 1 - seq.num_hidden_tokens < req.max_output_tokens and token_id not in req.eos_token_ids
                    and token_id not in req.stop_token_ids):
                continue        # the common step: check_stop would go on
            status, stop_reason = check_stop(req, seq, token_id, index + 1)
            if status is not None:
                done = self._finish(req, seq, status, stop_reason)
                if done is not None:
                    finished.append(done)
        return finished + self._beam_steps(beam_reqs, runner_out) if beam_reqs else finished

    def _finish(self, req: Request, seq: Sequence, status: RequestStatus,
                stop_reason: int | str | None) -> Request | None:
        """Finish ``seq`` and free its self blocks; retire ``req`` when it was the last live one."""
        seq.status = status
        seq.stop_reason = stop_reason
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            seq.token_ids.pop()   # a step past the stop, launched before the stop was known
        self.self_pool.free(seq.block_ids)
        seq.block_ids = []
        del self._live_seqs[seq.seq_id]
        if not req.is_finished:
            return None
        queue = self.running if req.status is RequestStatus.RUNNING else self.waiting
        # By identity: Request is a dataclass whose == would compare encoder inputs.
        del queue[next(i for i, r in enumerate(queue) if r is req)]
        if req.encoder_cache_key is not None and req.cross_block_ids and status is not RequestStatus.FINISHED_ABORTED:
            self.encoder_cache.keep(req.encoder_cache_key, req.cross_block_ids)
        else:
            self.cross_pool.free(req.cross_block_ids)
        req.cross_block_ids = []
        req.status = status   # each sequence keeps its own status for its CompletionOutput
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)
        return req
