"""BeamState's ranking rules with hand-made candidates (pure Python, no model)."""
import pytest

from enc2dec.engine.core.batch import BeamCandidate
from enc2dec.engine.core.beam_search import BeamState, normalized_score
from enc2dec.engine.core.request import RequestStatus, Sequence

EOS = 2


def _beams(*cum_logprobs, length=3):
    return {i: Sequence(token_ids=[0] + [7] * length, num_hidden_tokens=1, seq_id=i, cumulative_logprob=lp)
            for i, lp in enumerate(cum_logprobs)}


def _stop(parent, token):
    return (RequestStatus.FINISHED_STOPPED, None) if token == EOS else (None, None)


def _cand(parent, token, lp):
    return BeamCandidate(parent, token, lp, 0.0)


def test_only_top_width_candidates_may_finish_and_running_keeps_width_best():
    state = BeamState(width=2, num_returned=2)
    parents = _beams(-1.0, -1.5)
    cands = [_cand(0, 5, -1.1), _cand(0, EOS, -1.2), _cand(1, EOS, -1.6), _cand(1, 6, -1.7)]
    step = state.step(parents, cands, _stop, max_output_tokens=10)
    assert [c.token_id for _, c in step.running] == [5, 6]
    # EOS at rank 1 finishes; EOS at rank 2 is outside the first `width` candidates and is dropped.
    assert [h.token_ids for h in state.finished] == [[7, 7, 7, EOS]]
    assert state.finished[0].score == pytest.approx(normalized_score(-1.2, 4, 1.0))
    assert not step.is_done


@pytest.mark.parametrize("early_stopping, done", [(True, True), (False, True), ("never", False)])
def test_early_stopping_modes(early_stopping, done):
    state = BeamState(width=1, num_returned=1, length_penalty=1.0, early_stopping=early_stopping)
    parents = _beams(-0.5)
    # The finished hypothesis scores -0.6 / 4; the best running beam -0.9 / 4 now, but with
    # "never" and a positive penalty it is judged at max_output_tokens: -0.9 / 40 beats it.
    step = state.step(parents, [_cand(0, EOS, -0.6), _cand(0, 5, -0.9)], _stop, max_output_tokens=40)
    assert len(state.finished) == 1
    assert step.is_done is done


def test_all_candidates_stopping_ends_the_search_and_results_rank_by_score():
    state = BeamState(width=2, num_returned=2, length_penalty=2.0)
    parents = _beams(-1.0, -2.0)

    def length_stop(parent, token):
        return RequestStatus.FINISHED_LENGTH, None

    step = state.step(parents, [_cand(0, 5, -1.1), _cand(1, 6, -2.1), _cand(0, 8, -3.0)], length_stop, 4)
    assert step.is_done and not step.running
    hyps = state.results([], RequestStatus.FINISHED_ABORTED)
    assert [h.token_ids[-1] for h in hyps] == [5, 6]
    assert [h.status for h in hyps] == [RequestStatus.FINISHED_LENGTH] * 2
