"""The scheduler's beam-search half: copy-on-write of shared self blocks and the per-step
replacement of a request's beams by the survivors ``BeamState`` picks. Pure Python.

A mixin of ``Scheduler`` (it uses the scheduler's pools, limits, live-sequence table and
``_finish``); kept apart so the continuous-batching policy in ``scheduler.py`` reads on
its own.
"""
from __future__ import annotations

from collections import Counter

from enc2dec.engine.core.batch import BeamCandidate, ModelRunnerOutput, SchedulerOutput
from enc2dec.engine.core.beam_search import fork_sequence
from enc2dec.engine.core.request import Request, RequestStatus, Sequence
from enc2dec.engine.core.stop_rules import check_stop


class BeamScheduling:
    def _written_blocks(self, seq: Sequence) -> list[int]:
        """The blocks this step writes into (from the first uncomputed position on)."""
        return seq.block_ids[seq.num_computed_tokens // self.limits.tokens_per_block:]

    def _num_copy_on_write_blocks(self, seqs: list[Sequence]) -> int:
        """Copies ``_copy_on_write`` will make: every holder of a shared block it writes takes
        a copy, except the last one when nobody outside ``seqs`` holds the block."""
        holders = Counter(b for s in seqs for b in self._written_blocks(s) if self.self_pool.ref_count(b) > 1)
        return sum(n - (self.self_pool.ref_count(b) == n) for b, n in holders.items())

    def _copy_on_write(self, seq: Sequence, out: SchedulerOutput) -> None:
        first = seq.num_computed_tokens // self.limits.tokens_per_block
        block_ids = list(seq.block_ids)    # a new list: an earlier ScheduledSeq may hold the old one
        for i in range(first, len(block_ids)):
            block_id = block_ids[i]
            if self.self_pool.ref_count(block_id) > 1:
                (copy_id,) = self.self_pool.allocate(1)
                out.block_copies.append((block_id, copy_id))
                self.self_pool.free([block_id])
                block_ids[i] = copy_id
        seq.block_ids = block_ids

    @staticmethod
    def _num_unexpanded_beams(req: Request, seqs: list[Sequence]) -> int:
        return max(0, req.beam_width - len(seqs)) if seqs else 0

    def _beam_steps(self, beam_reqs: dict[str, Request], runner_out: ModelRunnerOutput) -> list[Request]:
        finished = []
        for rid, req in beam_reqs.items():
            done = self._beam_step(req, runner_out.beams[rid])
            if done is not None:
                finished.append(done)
        return finished

    def _beam_step(self, req: Request, candidates: list[BeamCandidate]) -> Request | None:
        """Replace the running beams by this step's survivors; returns ``req`` when its search is done."""
        parents = {s.seq_id: s for s in req.live_seqs}
        assert all(s.num_computed_tokens == s.num_tokens for s in parents.values()), \
            f"request {req.request_id}: its beams did not all step together"
        step = req.beam.step(parents, candidates, lambda p, tok: check_stop(req, p, tok, p.num_tokens + 1),
                             req.max_output_tokens)
        if step.is_done:
            status = req.beam.finished[0].status if req.beam.finished else RequestStatus.FINISHED_LENGTH
            done = None
            for seq in list(req.live_seqs):
                done = self._finish(req, seq, status, None)
            return done
        # Forks copy their parent before any survivor appends its token.
        survivors, claimed = [], set()
        for parent, cand in step.running:
            if parent.seq_id in claimed:
                child = fork_sequence(parent, self.self_pool.fork(parent.block_ids))
                self._live_seqs[child.seq_id] = (req, child)
            else:
                claimed.add(parent.seq_id)
                child = parent
            survivors.append((child, cand))
        for parent in parents.values():
            if parent.seq_id not in claimed:       # no child: its blocks go (shared ones lose a reference)
                self.self_pool.free(parent.block_ids)
                parent.block_ids = []
                del self._live_seqs[parent.seq_id]
        for rank, (child, cand) in enumerate(survivors):
            child.index = rank
            child.token_ids.append(cand.token_id)
            child.cumulative_logprob = cand.cumulative_logprob     # the device's float32 sum, as ranked
            if req.beam.keep_logprobs:     # in place: a fork copied its parent's list above
                if child.logprobs is None:
                    child.logprobs = []
                child.logprobs.append({cand.token_id: cand.logprob})
        req.seqs = [child for child, _ in survivors]
        return None
