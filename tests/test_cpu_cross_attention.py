"""Decode-step cross-attention of the torch backend (the CPU path) over Whisper-length encoder
K/V: rows whose runs of cross blocks are evenly spaced share one strided attention call, which
must give the per-row loop's result bit for bit (and the reference's to rounding). Rows on one
request's blocks (its beams) are that request's queries in one call: the K/V is read once, and
the product of several queries rounds like a matrix product, not like the loop's one-row ones.
Every test runs on both pool layouts: token-major (the Triton kernels') and head-major (what
``KVCache.allocate`` gives the torch backend), whose views must read the same positions."""
import pytest
import torch

from enc2dec.engine.models.attention import DecoderMetadata, TorchAttentionBackend
from enc2dec.kernels.reference import paged_attention_ref

TPB, HEADS, DIM, ENC_LEN = 32, 4, 16, 300          # 300 positions: 10 blocks, the last one partial
BLOCKS_PER_ROW = (ENC_LEN + TPB - 1) // TPB


def _meta(first_blocks: list[int], enc_lens: list[int] | None = None) -> DecoderMetadata:
    n = len(first_blocks)
    enc_lens = enc_lens or [ENC_LEN] * n
    tables = torch.tensor([[b + i for i in range(BLOCKS_PER_ROW)] for b in first_blocks], dtype=torch.int32)
    ones = torch.ones(n, dtype=torch.int32)
    return DecoderMetadata(query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=ones,
                           block_tables=torch.zeros(n, 1, dtype=torch.int32), slot_mapping=torch.arange(n),
                           cross_block_tables=tables, enc_lens=torch.tensor(enc_lens, dtype=torch.int32),
                           query_lens_host=[1] * n, seq_lens_host=[1] * n, enc_lens_host=enc_lens,
                           last_token_indices=torch.arange(n))


@pytest.fixture(params=[False, True], ids=["token_major", "head_major"])
def head_major(request):
    return request.param


def _pools(head_major: bool, num_blocks: int = 80):
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(num_blocks, TPB, HEADS, DIM, generator=gen) for _ in range(2))
    if head_major:      # the same values stored [H, blocks, T, D], seen as [blocks, T, H, D]
        k, v = (t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in (k, v))
        assert k.stride(2) == num_blocks * TPB * DIM
    return k, v, torch.randn(8, HEADS, DIM, generator=gen)


@pytest.mark.parametrize("first_blocks, num_calls, beams", [
    ([0, 10, 20, 30], 1, False),            # clips admitted one after another: back-to-back runs
    ([40, 0, 60, 20], 1, False),            # evenly spaced with gaps, rows not in pool order
    ([12, 12, 12], 1, True),                # beams of one request share its cross blocks
    ([7], 1, False),
    ([0, 10, 30, 40, 65], 3, False),        # uneven: [0, 10], [30, 40], [65]
    ([30, 30, 0, 0], 2, True),              # two requests' beams, the runs not in pool order
    ([0, 0, 10, 10, 20, 20], 3, True),      # three requests' beams on back-to-back runs (plan["runs"]: one call)
])
def test_strided_cross_attention_equals_the_per_row_loop(first_blocks, num_calls, beams, head_major):
    k, v, q_all = _pools(head_major)
    meta = _meta(first_blocks)
    q = q_all[:len(first_blocks)]
    backend = TorchAttentionBackend()
    plan = backend._cross_plan(meta, TPB, q.dtype)
    assert len(plan["groups"]) == num_calls
    got = backend.cross_attention(q, k, v, meta, 0.25)
    loop = TorchAttentionBackend._cross_views(q, k, v, meta, 0.25, plan["starts"], TPB)
    # The same flash computation per (row, head): bit for bit on one thread. With more, SDPA's
    # split of the work among threads depends on the call's shape and the CPU (an AVX2 machine
    # rounded 4-9e-8 apart), and beams' queries share one call, so float32 rounding.
    torch.testing.assert_close(got, loop, atol=1e-6, rtol=0)
    if not beams:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(backend.cross_attention(q, k, v, meta, 0.25),
                               TorchAttentionBackend._cross_views(q, k, v, meta, 0.25, plan["starts"], TPB))
        finally:
            torch.set_num_threads(threads)
    ref = paged_attention_ref(q, k, v, meta.query_start_loc, meta.enc_lens, meta.cross_block_tables, 0.25,
                              causal=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_rows_of_different_lengths_keep_the_per_row_path(head_major):
    k, v, q_all = _pools(head_major)
    meta = _meta([0, 10], [ENC_LEN, ENC_LEN - 40])
    q = q_all[:2]
    backend = TorchAttentionBackend()
    assert backend._cross_plan(meta, TPB, q.dtype)["groups"] is None
    got = backend.cross_attention(q, k, v, meta, 0.25)
    ref = paged_attention_ref(q, k, v, meta.query_start_loc, meta.enc_lens, meta.cross_block_tables, 0.25,
                              causal=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def _short_meta(first_blocks: list[int], enc_len: int, self_tables: list[list[int]], seq_lens: list[int]):
    n = len(first_blocks)
    nb = (enc_len + TPB - 1) // TPB
    return DecoderMetadata(query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           block_tables=torch.tensor(self_tables, dtype=torch.int32), slot_mapping=torch.arange(n),
                           cross_block_tables=torch.tensor([[b + i for i in range(nb)] for b in first_blocks],
                                                           dtype=torch.int32),
                           enc_lens=torch.full((n,), enc_len, dtype=torch.int32), query_lens_host=[1] * n,
                           seq_lens_host=seq_lens, enc_lens_host=[enc_len] * n, last_token_indices=torch.arange(n))


@pytest.mark.parametrize("first_blocks, strided", [
    ([3], True), ([0, 1, 2, 3], True), ([5, 1, 3], True),   # a text prompt's one block per request
    ([0, 1, 5, 6, 20, 22], False),                          # 3 groups: a gather and one call instead
])
def test_short_encoders_of_equal_length_are_read_in_place(first_blocks, strided, head_major):
    """A text encoder's K/V (here 40 positions: two blocks, the second partial) is read as a view
    of the pool when the rows fall into at most two evenly spaced groups, with the gathered
    path's result."""
    k, v, q_all = _pools(head_major)
    n = len(first_blocks)
    meta = _short_meta([2 * b for b in first_blocks], 40, [[0]] * n, [1] * n)
    q = q_all[:n]
    backend = TorchAttentionBackend()
    assert (backend._cross_plan(meta, TPB, q.dtype)["groups"] is not None) == strided
    got = backend.cross_attention(q, k, v, meta, 0.25)
    ref = paged_attention_ref(q, k, v, meta.query_start_loc, meta.enc_lens, meta.cross_block_tables, 0.25,
                              causal=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tables, seq_lens, strided", [
    ([[4]], [17], True),                                 # one request, one block
    ([[4, 5, 6]], [70], True),                           # one request on consecutive blocks
    ([[0, 1], [2, 3], [4, 5]], [40, 64, 33], True),      # admitted together, allocated in turn
    ([[0], [1], [2]], [9, 3, 30], True),
    ([[0, 3], [1, 4]], [40, 50], False),                 # blocks interleaved: gathered
    ([[2], [0]], [5, 5], False),                         # rows out of pool order: gathered
])
def test_decode_self_attention_reads_evenly_spaced_pages_in_place(tables, seq_lens, strided, head_major):
    """A decode step's self-attention over the paged cache, with and without T5's relative bias:
    pages on evenly spaced runs of blocks are a strided view (no gather), and every layout gives
    the reference's result, each row masked to its own length."""
    k, v, q_all = _pools(head_major)
    n = len(tables)
    meta = _short_meta([0] * n, 8, tables, seq_lens)
    q = q_all[:n]
    bias = torch.randn(HEADS, 128, generator=torch.Generator().manual_seed(1))
    for table in (None, bias):
        backend = TorchAttentionBackend()
        got = backend.self_attention(q, k, v, meta, 0.25, table)
        assert (backend._dec[1]["self_run"] is not None) == strided
        ref = paged_attention_ref(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
                                  causal=True, bias_table=table)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
