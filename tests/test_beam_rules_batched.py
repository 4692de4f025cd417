"""Beam rows apply Whisper's rules batched, each beam over its own ids: the candidates of
``_beam_candidates`` (tokens, parents, scores) equal those of the same rules run row by row,
for beams whose histories end in text, a lone timestamp or a closed pair, before and at the
rules' begin index, beside a row that is not a beam."""

import torch
from enc2dec.engine.runner.sampler import BeamGroup, SeqSamplingState, _beam_candidates
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules

VOCAB, EOT, NO_TS, TS = 64, 30, 39, 40          # text [0, 40), timestamps [40, 64)
LANGS, FORCED = [50, 51, 55], [33, 34]          # language "tokens" and the forced task / no-timestamps ids


class _RowByRow:
    """A rule as a plain Python processor: the sampler then runs its ``__call__`` row by row."""

    def __init__(self, rule):
        self.rule = rule

    def __call__(self, ids, row):
        self.rule(ids, row)


class _BanAfterSeven:
    """A custom processor (row by row in both runs): no 8 right after a 7."""

    def __call__(self, ids, row):
        if ids and ids[-1] == 7:
            row[8] = float("-inf")


def _beam_state(rules, row_by_row: bool, begin_suppress=()) -> SeqSamplingState:
    processors = [_RowByRow(r) if row_by_row else r for r in rules] + [_BanAfterSeven()]
    params = SamplingParams(max_tokens=40, use_beam_search=True, best_of=4, logits_processors=processors)
    return SeqSamplingState(params, (EOT,), (), suppress_token_ids=(2, 3), begin_suppress_token_ids=begin_suppress)


def _groups():
    """Per beam group: its rules, begin-suppress ids and its beams' histories (not all one length)."""
    timestamps = [SuppressAtBegin(1, (EOT, 7)), TimestampRules(1, EOT, NO_TS, TS, 5)]
    detecting = [DetectLanguage(LANGS, FORCED), SuppressAtBegin(3, (EOT, 7)),
                 TimestampRules(3, EOT, NO_TS, TS, 5, end_not_before=TS + 10)]
    opened = [TimestampRules(0, EOT, NO_TS, TS, None, open_segment_at=TS + 3)]
    return [
        (timestamps, (), [[5, TS + 2, 7],                   # text after a stamp (ends in a 7)
                          [5, TS + 2, 9, TS + 6],           # a lone stamp
                          [5, TS + 2, 9, TS + 6, TS + 6],   # a closed pair
                          [5, TS + 2],                      # the first stamp only
                          [5]]),                            # at the begin index: a stamp must open
        (detecting, (EOT,), [[]]),                          # language detection at output 0
        (detecting, (), [[50], [51, 33]]),                  # the forced tokens
        (detecting, (), [[50, 33, 34],                      # at its begin index
                         [50, 33, 34, TS, 4, 5, TS + 4],    # a lone stamp short of end_not_before
                         [50, 33, 34, TS, 4, TS + 10, TS + 10],
                         [50, 33, 34, TS, 4, 6]]),
        (opened, (), [[], [6, 7], [6, TS + 5], [6, TS + 5, TS + 5]]),
    ]


def _step(row_by_row: bool, logits: torch.Tensor):
    states, histories, groups, scores = [], [], [], []
    gen = torch.Generator().manual_seed(5)
    for g, (rules, begin_suppress, beams) in enumerate(_groups()):
        if g == 1:              # a row that is no beam between the groups: the beam rows are not contiguous
            states.append(SeqSamplingState(SamplingParams(max_tokens=8, temperature=0.0), (EOT,), ()))
            histories.append(None)
        groups.append(BeamGroup(len(states), len(beams), 2 * len(beams)))
        for ids in beams:
            states.append(_beam_state(rules, row_by_row, begin_suppress if not ids else ()))
            histories.append(list(ids))
        # Close scores, so that candidates come from every beam of a group.
        scores += (-torch.rand(len(beams), generator=gen) * 0.5 - len(beams[0])).tolist()
    counts = [len(h) if h is not None else 0 for h in histories]
    return _beam_candidates(logits[:len(states)], states, counts, groups, scores, histories)


def test_beam_candidates_with_batched_rules_equal_the_row_by_row_rules():
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    logits[::2, TS:] += 3.5                  # rows where the timestamps are likelier than any text
    logits[:, 8] += 6.0                      # tempting, but banned right after a 7
    batched, reference = _step(False, logits), _step(True, logits)
    for name in ("token_ids", "parent_rows", "cumulative_logprobs", "logprobs"):
        assert torch.equal(getattr(batched, name), getattr(reference, name)), name
    assert batched.num_keep == reference.num_keep
    out = batched.output()
    assert {parent for parent, *_ in out[0]} == set(range(5))        # every beam of the first group proposes
    text_after_pair = [t for parent, t, *_ in out[0] if parent == 2]
    assert text_after_pair and all(t < TS for t in text_after_pair)  # a closed pair: text (or EOT) follows
    assert all(t in LANGS for _, t, *_ in out[1])                    # detection keeps only languages
    forced = [(parent, t) for parent, t, score, _ in out[2] if score > float("-inf")]
    assert sorted(forced) == [(0, FORCED[0]), (1, FORCED[1])]       # forced: each beam's one finite candidate
    assert 8 not in [t for parent, t, *_ in out[0] if parent == 0]   # the custom processor still runs


def _plain_beam_state() -> SeqSamplingState:
    return SeqSamplingState(SamplingParams(max_tokens=40, use_beam_search=True, best_of=4), (EOT,), ())


def _reference_candidates(logits, groups, scores):
    """Each group's best continuations over its own beams only, computed group by group."""
    logp = logits.float().log_softmax(dim=-1)
    out = []
    for g in groups:
        rows = slice(g.start, g.start + g.num_rows)
        flat = (logp[rows] + torch.tensor(scores[rows], dtype=torch.float32)[:, None]).reshape(-1)
        top, idx = flat.topk(g.num_keep)
        out.append((top, idx // VOCAB, idx % VOCAB, logp[rows].reshape(-1)[idx]))
    return out


def test_candidates_of_groups_at_full_width_and_of_a_narrower_group_are_each_groups_own_best():
    # Full width: the rows are read in place; a narrower group: padded with beams of -inf. Both
    # must give every group exactly its own best continuations, none from a neighbour's rows.
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    for widths in ([4, 4, 4], [4, 2, 4]):
        groups, start = [], 0
        for w in widths:
            groups.append(BeamGroup(start, w, 8))
            start += w
        scores = (-torch.rand(start, generator=torch.Generator().manual_seed(8)) * 2).tolist()
        states = [_plain_beam_state() for _ in range(start)]
        got = _beam_candidates(logits[:start], states, [3] * start, groups, scores, [[1, 2, 3]] * start)
        for gi, (top, parents, tokens, lps) in enumerate(_reference_candidates(logits[:start], groups, scores)):
            assert torch.equal(got.token_ids[gi], tokens), widths
            assert torch.equal(got.parent_rows[gi], parents), widths
            assert torch.allclose(got.cumulative_logprobs[gi], top), widths
            assert torch.equal(got.logprobs[gi], lps), widths
