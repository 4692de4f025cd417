"""The decode-graph staging layout (plain numpy, no GPU): what a replayed graph reads."""
import random

import numpy as np

from enc2dec.engine.core.batch import ScheduledSeq
from enc2dec.engine.runner.cuda_graph import fill_staging

B, TPB, SELF_W, CROSS_W = 8, 4, 6, 5


def _seqs(n, seed):
    rnd = random.Random(seed)
    seqs = []
    for i in range(n):
        seq_len = rnd.randint(1, SELF_W * TPB)
        blocks = rnd.sample(range(100), -(-seq_len // TPB))
        enc_len = rnd.randint(1, CROSS_W * TPB)
        seqs.append(ScheduledSeq(seq_id=i, request_id=f"r{i}", input_token_ids=[rnd.randint(0, 500)],
                                 start_pos=seq_len - 1, block_ids=blocks,
                                 cross_block_ids=rnd.sample(range(100), -(-enc_len // TPB)), encoder_len=enc_len,
                                 num_output_tokens=0))
    return seqs


def _fields(h64, h32):
    o_bt = 3 * B + 1
    return dict(ids=h64[:B], pos=h64[B:2 * B], slots=h64[2 * B:3 * B], last=h64[3 * B:4 * B],
                fill_dst=h64[4 * B:5 * B], fill_src=h64[5 * B:],
                qsl=h32[:B + 1], seq_lens=h32[B + 1:2 * B + 1], enc_lens=h32[2 * B + 1:3 * B + 1],
                bt=h32[o_bt:o_bt + B * SELF_W].reshape(B, SELF_W),
                cbt=h32[o_bt + B * SELF_W:].reshape(B, CROSS_W))


def test_staging_rows_hold_each_sequence_and_padding_rows_write_nowhere():
    n32 = (B + 1) + 2 * B + B * SELF_W + B * CROSS_W
    h64, h32 = np.full(6 * B, 77, np.int64), np.full(n32, 77, np.int32)    # poisoned: stale values must go
    for n in (0, 1, 5, B):
        seqs = _seqs(n, seed=n)
        fill_staging(h64, h32, seqs, B, TPB, SELF_W, CROSS_W)
        f = _fields(h64, h32)
        assert f["last"].tolist() == list(range(B)) and f["qsl"].tolist() == list(range(B + 1))
        for i, s in enumerate(seqs):
            p = s.start_pos
            assert f["ids"][i] == s.input_token_ids[0] and f["pos"][i] == p
            assert f["slots"][i] == s.block_ids[p // TPB] * TPB + p % TPB
            assert f["seq_lens"][i] == s.seq_len and f["enc_lens"][i] == s.encoder_len
            assert f["bt"][i].tolist() == s.block_ids + [0] * (SELF_W - len(s.block_ids))
            assert f["cbt"][i].tolist() == s.cross_block_ids + [0] * (CROSS_W - len(s.cross_block_ids))
        for i in range(n, B):          # padding: slot -1, one key, one encoder position, block 0
            assert f["slots"][i] == -1 and f["seq_lens"][i] == 1 and f["enc_lens"][i] == 1
            assert not f["bt"][i].any() and not f["cbt"][i].any() and f["ids"][i] == 0


def test_the_overlaps_placeholder_rows_travel_in_the_same_staging_copy():
    # [rows whose input is a placeholder, rows of the previous step's samples they take]: the
    # graph runner scatters prev_tokens[src] into ids[dst] on the device from these two fields
    n32 = (B + 1) + 2 * B + B * SELF_W + B * CROSS_W
    h64, h32 = np.full(6 * B, 77, np.int64), np.full(n32, 77, np.int32)
    seqs = _seqs(5, seed=3)
    fill_staging(h64, h32, seqs, B, TPB, SELF_W, CROSS_W, fill=[[0, 2, 4], [3, 0, 1]])
    f = _fields(h64, h32)
    assert f["fill_dst"][:3].tolist() == [0, 2, 4] and f["fill_src"][:3].tolist() == [3, 0, 1]
    assert f["ids"][1] == seqs[1].input_token_ids[0] and f["last"].tolist() == list(range(B))
    fill_staging(h64, h32, seqs, B, TPB, SELF_W, CROSS_W)       # a step without placeholders
    f = _fields(h64, h32)
    assert not f["fill_dst"].any() and not f["fill_src"].any()


def test_the_runner_scatters_the_previous_samples_into_the_placeholder_rows():
    # DecodeGraphRunner.run's copy and scatter, on CPU tensors (no capture, no replay): the rows
    # named in fill take prev_tokens[src]; the other rows keep their staged ids
    import torch

    from enc2dec.engine.runner.cuda_graph import DecodeGraphRunner

    g = object.__new__(DecodeGraphRunner)
    g.device, g.sizes, g.max_b, g.tpb, g.self_width, g.cross_width = torch.device("cpu"), [B], B, TPB, SELF_W, CROSS_W
    g._make_staging(pin=False)
    seqs = _seqs(6, seed=11)
    prev = torch.tensor([900, 901, 902, 903, 904, 905, 906])
    g.run(seqs, [[1, 3, 4], [6, 0, 2]], prev, replay=False)
    ids = g._dev64[:B].tolist()
    assert [ids[1], ids[3], ids[4]] == [906, 900, 902]
    assert [ids[i] for i in (0, 2, 5)] == [seqs[i].input_token_ids[0] for i in (0, 2, 5)]
    g.run(seqs, None, prev, replay=False)           # the next step, in the other staging set
    assert g._dev64[:6].tolist() == [s.input_token_ids[0] for s in seqs]


def test_rows_kept_between_steps_match_a_full_rewrite_as_the_batch_changes():
    # The graph runner's staging sets keep the block-table rows of unchanged sequences between
    # steps; after each change of the batch (a sequence grows into a new block, one finishes and
    # another takes its row, the batch shrinks, grows, empties) the tables must equal a full rewrite.
    import dataclasses

    n32 = (B + 1) + 2 * B + B * SELF_W + B * CROSS_W
    kept64, kept32 = np.full(6 * B, 77, np.int64), np.zeros(n32, np.int32)
    held = ([], [])
    seqs = _seqs(6, seed=11)
    rnd = random.Random(5)
    for step in range(12):
        if step % 3 == 1:                 # a table grows: a new list (the scheduler never mutates one)
            i = rnd.randrange(len(seqs))
            s = seqs[i]
            if len(s.block_ids) < SELF_W:
                seqs[i] = dataclasses.replace(s, block_ids=s.block_ids + [rnd.randrange(100)])
        elif step % 3 == 2 and seqs:      # another request takes a finished one's row
            seqs[rnd.randrange(len(seqs))] = _seqs(1, seed=100 + step)[0]
        if step == 6:
            seqs = seqs[:2]
        elif step == 8:
            seqs = seqs + _seqs(B - len(seqs), seed=200)
        elif step == 10:
            seqs = []
        fill_staging(kept64, kept32, seqs, B, TPB, SELF_W, CROSS_W, held=held)
        full64, full32 = np.full(6 * B, 77, np.int64), np.full(n32, 77, np.int32)
        fill_staging(full64, full32, seqs, B, TPB, SELF_W, CROSS_W)
        assert kept64.tolist() == full64.tolist() and kept32.tolist() == full32.tolist(), f"step {step}"
