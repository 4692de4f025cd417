"""The runner's eager decode inputs and placeholder sources (numpy-built) against a per-sequence
reference: what the model reads when no CUDA graph replays (every CPU step)."""
import random

import pytest
import torch

from enc2dec.engine.core.batch import ScheduledSeq
from enc2dec.engine.core.request import PLACEHOLDER_TOKEN_ID
from enc2dec.engine.runner.model_runner import ModelRunner

TPB = 4


def _runner(prev_seq_ids, prev_tokens):
    r = object.__new__(ModelRunner)
    r.device, r.tokens_per_block = torch.device("cpu"), TPB
    r._prev_rows = {sid: i for i, sid in enumerate(prev_seq_ids)}
    r._prev_tokens = torch.tensor(prev_tokens, dtype=torch.long)
    return r


def _batch(seed):
    """Sequences feeding 1-5 tokens (first steps feed a prefix), some ending in a placeholder, and
    the previous step's rows in another order, with sequences that were not in it."""
    rnd = random.Random(seed)
    seqs = []
    for i in range(rnd.randint(1, 12)):
        n_new = rnd.choice([1, 1, 1, 2, 5])
        start = rnd.randint(0, 20)
        blocks = rnd.sample(range(200), -(-(start + n_new) // TPB) + rnd.randint(0, 1))    # maybe one spare
        ids = [rnd.randint(0, 900) for _ in range(n_new)]
        if n_new == 1 and rnd.random() < 0.7:
            ids = [PLACEHOLDER_TOKEN_ID]
        enc_len = rnd.randint(1, 30)
        seqs.append(ScheduledSeq(seq_id=100 + i, request_id=f"r{i}", input_token_ids=ids, start_pos=start,
                                 block_ids=blocks, cross_block_ids=rnd.sample(range(200), -(-enc_len // TPB)),
                                 encoder_len=enc_len, num_output_tokens=start))
    prev = [s.seq_id for s in seqs if s.input_token_ids == [PLACEHOLDER_TOKEN_ID]] + [7, 8]
    rnd.shuffle(prev)
    return seqs, prev, [rnd.randint(1000, 2000) for _ in prev]


def _reference(seqs, prev, prev_tokens):
    fed, pos, slots, qsl = [], [], [], [0]
    for s in seqs:
        for j, t in enumerate(s.input_token_ids):
            p = s.start_pos + j
            fed.append(prev_tokens[prev.index(s.seq_id)] if t == PLACEHOLDER_TOKEN_ID else t)
            pos.append(p)
            slots.append(s.block_ids[p // TPB] * TPB + p % TPB)
        qsl.append(qsl[-1] + len(s.input_token_ids))

    def table(rows):
        width = max(len(r) for r in rows)
        return [r + [0] * (width - len(r)) for r in rows]

    return dict(ids=fed, pos=pos, slots=slots, qsl=qsl, last=[q - 1 for q in qsl[1:]],
                seq_lens=[s.start_pos + len(s.input_token_ids) for s in seqs], enc_lens=[s.encoder_len for s in seqs],
                bt=table([s.block_ids for s in seqs]), cbt=table([s.cross_block_ids for s in seqs]))


@pytest.mark.parametrize("seed", range(25))
def test_eager_inputs_match_a_per_sequence_reference(seed):
    seqs, prev, prev_tokens = _batch(seed)
    r = _runner(prev, prev_tokens)
    fill = r._placeholder_sources(seqs)
    ids, pos, meta = r._prepare_decode(seqs, fill)
    want = _reference(seqs, prev, prev_tokens)
    assert ids.tolist() == want["ids"] and pos.tolist() == want["pos"]
    assert meta.slot_mapping.tolist() == want["slots"] and meta.query_start_loc.tolist() == want["qsl"]
    assert meta.last_token_indices.tolist() == want["last"]
    assert meta.seq_lens.tolist() == want["seq_lens"] == meta.seq_lens_host
    assert meta.enc_lens.tolist() == want["enc_lens"] == meta.enc_lens_host
    assert meta.query_lens_host == [len(s.input_token_ids) for s in seqs]
    assert meta.block_tables.tolist() == want["bt"] and meta.cross_block_tables.tolist() == want["cbt"]
    assert (meta.query_start_loc.dtype, meta.seq_lens.dtype, meta.block_tables.dtype, meta.enc_lens.dtype) == \
        (torch.int32,) * 4
    assert (ids.dtype, pos.dtype, meta.slot_mapping.dtype, meta.last_token_indices.dtype) == (torch.long,) * 4
    # Fields share one copy each way; each starts on 16 bytes, as a fresh tensor would (Triton
    # compiles a kernel variant per pointer alignment).
    fields = [ids, pos, meta.slot_mapping, meta.last_token_indices, meta.query_start_loc, meta.seq_lens,
              meta.enc_lens, meta.block_tables, meta.cross_block_tables]
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in fields)


def test_no_placeholder_means_no_fill_and_a_missing_source_is_an_error():
    seqs, prev, prev_tokens = _batch(3)
    real = [s for s in seqs if s.input_token_ids != [PLACEHOLDER_TOKEN_ID]]
    r = _runner(prev, prev_tokens)
    assert r._placeholder_sources(real) is None
    orphan = ScheduledSeq(seq_id=999, request_id="x", input_token_ids=[PLACEHOLDER_TOKEN_ID], start_pos=3,
                          block_ids=[5], cross_block_ids=[6], encoder_len=2, num_output_tokens=3)
    with pytest.raises(KeyError, match="999"):
        r._placeholder_sources([orphan])

