"""The batched form of each Whisper rule against its row-by-row form (the readable reference,
which the real-checkpoint tests hold to transformers), on random logits and on histories the
grammar itself produced, and the sampler's device-side history across steps."""

import random

import pytest
import torch
from enc2dec.engine.runner.sampler import Sampler, SeqSamplingState
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules

VOCAB, EOT, NO_TS, TS = 64, 30, 39, 40          # text [0, 40), timestamps [40, 64)


def _same(batched: torch.Tensor, reference: torch.Tensor):
    assert torch.equal(torch.isinf(batched), torch.isinf(reference))
    finite = ~torch.isinf(reference)
    assert torch.allclose(batched[finite], reference[finite])


def _grammar_history(rule: TimestampRules, length: int, rnd: random.Random) -> list[int]:
    """Output ids the rule allows: each step the argmax of random logits under the rule."""
    ids = [rnd.randrange(TS) for _ in range(rule.begin_index)]          # forced tokens before the text
    while len(ids) < length:
        row = torch.tensor([rnd.gauss(0, 2) for _ in range(VOCAB)])
        row[EOT] = float("-inf")                                         # keep going
        rule(ids, row)
        ids.append(int(row.argmax()))
    return ids


@pytest.mark.parametrize("max_initial", [None, 5])
def test_timestamp_rules_batched_equals_row_by_row(max_initial):
    rnd = random.Random(0)
    rules, histories = [], []
    # open_at: a prompt that opened a segment (a forced prefix) before the output; end_from: no
    # EOT after text until a stamp at or past it.
    for begin, open_at, end_from in ((0, None, None), (2, None, None), (0, TS + 3, None), (2, TS + 3, None),
                                     (0, None, TS + 6), (2, TS + 3, TS + 6)):
        rule = TimestampRules(begin, EOT, NO_TS, TS, max_initial, open_segment_at=open_at, end_not_before=end_from)
        for length in range(0, 14):          # before the text, empty text, lone and paired stamps
            rules.append(rule)
            histories.append(_grammar_history(rule, length, rnd))
    logits = torch.randn(len(rules), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    logits[::3, TS:] += 4                    # rows where the timestamps are likelier than any text
    width = 16
    history = torch.full((len(rules), width), -1, dtype=torch.long)
    for i, ids in enumerate(histories):
        history[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        history[i, len(ids):] = rnd.randrange(VOCAB)    # stale ids past the count must not matter
    reference = logits.clone()
    for i, (rule, ids) in enumerate(zip(rules, histories)):
        rule(ids, reference[i])
    batched = TimestampRules.apply_batch(logits.clone(), rules, [len(h) for h in histories], history)
    _same(batched, reference)
    assert not torch.equal(reference, logits)       # the rules did act on these rows


def test_detect_language_and_suppress_at_begin_batched_equal_row_by_row():
    langs, forced = [50, 51, 55], [33, 34]
    detect = DetectLanguage(langs, forced)
    begin = SuppressAtBegin(3, (EOT, 7))
    counts = [0, 1, 2, 3, 4, 0]
    logits = torch.randn(len(counts), VOCAB, generator=torch.Generator().manual_seed(2))
    reference = logits.clone()
    for i, n in enumerate(counts):
        detect([-1] * n, reference[i])
        begin([-1] * n, reference[i])
    batched = DetectLanguage.apply_batch(logits.clone(), [detect] * len(counts), counts)
    batched = SuppressAtBegin.apply_batch(batched, [begin] * len(counts), counts)
    _same(batched, reference)
    assert torch.isinf(batched[0]).sum() == VOCAB - len(langs)
    assert batched[1].argmax() == forced[0] and batched[2].argmax() == forced[1]


def _state(rules):
    return SeqSamplingState(SamplingParams(max_tokens=20, temperature=0.0, logits_processors=rules), (EOT,), ())


def test_sampler_keeps_each_rows_history_on_the_device_across_steps():
    """Rows with the timestamp grammar, a row without, rows joining late and leaving early:
    every step the sampler's choice equals the row-by-row rule over the host-side ids."""
    rule = TimestampRules(0, EOT, NO_TS, TS, 3)
    states = {sid: _state([rule]) for sid in (10, 11, 12)} | {13: _state(None)}
    host = {sid: [] for sid in states}
    sampler = Sampler()
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        live = [sid for sid in states if not (sid == 12 and step < 4) and not (sid == 11 and step > 8)]
        if step == 9:
            sampler.release([11])
        logits = torch.randn(len(live), VOCAB, generator=gen) * 2
        logits[:, EOT] = float("-inf")
        logits[:, TS:] += 1.5
        out = sampler.sample(logits, [states[s] for s in live], [len(host[s]) for s in live],
                             seq_ids=live).output().token_ids
        for i, sid in enumerate(live):
            row = logits[i].clone()
            if states[sid].params.logits_processors:
                rule(host[sid], row)
            assert out[i] == int(row.argmax()), (step, sid)
            host[sid].append(out[i])
    assert any(t >= TS for t in host[10]) and any(t < TS for t in host[10])


def test_an_open_segment_lets_text_continue_and_time_move_on():
    row = torch.zeros(VOCAB)
    row[:TS] = 5.0                                         # text likelier than all stamps together
    TimestampRules(0, EOT, NO_TS, TS, 5, open_segment_at=TS + 3)([], row)
    assert torch.isfinite(row[:EOT]).all()                 # text may follow the prompt's text
    assert torch.isinf(row[TS:TS + 4]).all() and torch.isfinite(row[TS + 4:]).all()   # a later stamp may close it
    fresh = torch.zeros(VOCAB)
    fresh[:TS] = 5.0
    TimestampRules(0, EOT, NO_TS, TS, 5)([], fresh)
    assert torch.isinf(fresh[:TS]).all()                   # without it the output opens with a stamp


def test_end_not_before_holds_eot_back_until_a_late_enough_stamp_once_there_is_text():
    def eot_allowed(ids: list[int]) -> bool:
        row = torch.zeros(VOCAB)
        row[EOT] = 10.0                                    # the model would end here
        TimestampRules(0, EOT, NO_TS, TS, 5, end_not_before=TS + 10)(ids, row)
        return bool(torch.isfinite(row[EOT]))

    assert not eot_allowed([TS, 1, 2, TS + 4])             # words stopped at 4 steps of 10: go on
    assert not eot_allowed([TS, 1, 2, TS + 4, TS + 4])
    assert eot_allowed([TS, 1, 2, TS + 4, TS + 4, 3, TS + 10])   # a stamp at the bound: it may end
    assert eot_allowed([TS])                               # no text at all (silence): it may end
    row = torch.zeros(VOCAB)
    row[EOT] = 10.0
    TimestampRules(0, EOT, NO_TS, TS, 5)([TS, 1, 2, TS + 4], row)
    assert torch.isfinite(row[EOT])                        # without the bound a lone stamp may end the text
