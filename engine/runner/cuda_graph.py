"""CUDA graphs for decoder steps and encoder batches, applied from outside the model.

One graph per padded batch size in the capture grid, each recording
``model.decode`` + ``model.compute_logits`` over static input buffers. A step whose
sequences all feed exactly one token (every pure decode step, and T5/BART steps that
mix newly encoded requests whose prefix is one token) and whose block tables fit the
captured widths replays the smallest graph that holds it; anything else runs eagerly.

Padding rows write nowhere (slot -1) and attend to one position of block 0; their
logits are dropped. Attention split counts are fixed at capture for the longest
sequence, which is safe because the kernels mask by the per-sequence lengths.

Encoder graphs (``EncoderGraphRunner``, per ``encoder_cuda_graph_config``, on by default) record
``model.encode`` + ``write_cross_kv`` per (batch, length) bucket over the padded layout of
``EncoderMetadata``: each request takes ``L`` token slots, keys past its real length are
masked, padding tokens and padding requests write to slot -1. Whisper has one length (1500).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time

import numpy as np
import torch

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata
from enc2dec.engine.core.block_manager import slot_ids
from enc2dec.engine.runner.host_to_device import to_device

logger = logging.getLogger("enc2dec")

# Per-row fields read with map(): one C-level pass over the batch, not a Python loop per row.
_INPUTS, _START = operator.attrgetter("input_token_ids"), operator.attrgetter("start_pos")
_BLOCKS, _CROSS = operator.attrgetter("block_ids"), operator.attrgetter("cross_block_ids")
_ENC_LEN, _FIRST = operator.attrgetter("encoder_len"), operator.itemgetter(0)


# int64 staging fields of a decode step (fill_staging): input ids, positions, self slots,
# last-token rows, and the overlap's placeholder rows with the sample rows they take
INT64_FIELDS = 6


class DecodeGraphRunner:
    def __init__(self, model, kv, device, capture_sizes: list[int], max_decoder_len: int,
                 max_encoder_len: int, tokens_per_block: int):
        self.model, self.kv, self.device = model, kv, device
        self.sizes = sorted(set(capture_sizes))
        self.max_b = self.sizes[-1]
        self.tpb = tokens_per_block
        self.max_decoder_len = max_decoder_len
        self.max_encoder_len = max_encoder_len
        self.self_width = -(-max_decoder_len // tokens_per_block)
        self.cross_width = -(-max_encoder_len // tokens_per_block)
        self._make_staging(pin=True)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _make_staging(self, pin: bool) -> None:
        """The step's input buffers: two host staging sets (pinned on a GPU) and their device copy."""
        b = self.max_b
        # int32 fields: query_start_loc (b+1), seq_lens, enc_lens, block tables
        n32 = (b + 1) + 2 * b + b * self.self_width + b * self.cross_width

        def host(n, dtype):
            t = torch.zeros(n, dtype=dtype)
            return t.pin_memory() if pin else t

        # Two staging sets, used in turn: with the overlap scheduler the host fills step N+1's
        # inputs while step N's copy may still be queued; N-1's copy is known done.
        self._staging = [(host(INT64_FIELDS * b, torch.long), host(n32, torch.int32)) for _ in range(2)]
        self._turn = 0
        # Per staging set: the block-id lists its table rows hold (fill_staging's ``held``)
        self._held = [([], []) for _ in range(2)]
        self._dev64 = torch.zeros(INT64_FIELDS * b, dtype=torch.long, device=self.device)
        self._dev32 = torch.zeros(n32, dtype=torch.int32, device=self.device)

    # ---- static views -----------------------------------------------------------------------
    def _views(self, buf64, buf32, b: int):
        B = self.max_b
        ids, pos, slots, last = (buf64[i * B:i * B + b] for i in range(4))
        o = 0
        qsl = buf32[o:o + b + 1]; o += B + 1
        seq_lens = buf32[o:o + b]; o += B
        enc_lens = buf32[o:o + b]; o += B
        bt = buf32[o:o + B * self.self_width].view(B, self.self_width)[:b]; o += B * self.self_width
        cbt = buf32[o:o + B * self.cross_width].view(B, self.cross_width)[:b]
        return ids, pos, slots, last, qsl, seq_lens, enc_lens, bt, cbt

    def _meta(self, b: int) -> tuple[torch.Tensor, torch.Tensor, DecoderMetadata]:
        ids, pos, slots, last, qsl, seq_lens, enc_lens, bt, cbt = self._views(self._dev64, self._dev32, b)
        meta = DecoderMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt, slot_mapping=slots,
            cross_block_tables=cbt, enc_lens=enc_lens, query_lens_host=[1] * b,
            seq_lens_host=[self.max_decoder_len] * b, enc_lens_host=[self.max_encoder_len] * b,
            last_token_indices=last)
        return ids, pos, meta

    # ---- capture ----------------------------------------------------------------------------
    def capture(self) -> None:
        t0 = time.perf_counter()
        self._fill_dummy()
        for b in reversed(self.sizes):                     # largest first: later graphs reuse its pool
            ids, pos, meta = self._meta(b)
            for _ in range(2):                             # warm up (Triton compiles, allocator settles)
                self._forward(ids, pos, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[b] = self._forward(ids, pos, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decoder CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), ",".join(map(str, self.sizes)), time.perf_counter() - t0)

    def release(self) -> None:
        """Destroy every graph and drop the pool. NCCL (2.26 and later) will not tear down a
        communicator while a graph that captured one of its kernels exists: its abort spins until
        those graphs are gone, so tensor-parallel shutdown calls this first."""
        _destroy(self.graphs, self.device)
        self.logits.clear()
        self.pool = None

    def _forward(self, ids, pos, meta):
        hidden = self.model.decode(ids, pos, meta, self.kv)                 # [b, d_model]
        return self.model.compute_logits(hidden[meta.last_token_indices])   # [b, vocab]

    def _fill_dummy(self) -> None:
        self.run([], None, None, replay=False)

    # ---- replay -----------------------------------------------------------------------------
    def can_run(self, seqs) -> bool:
        if len(seqs) > self.max_b:
            return False
        if not seqs:
            return True
        return (set(map(len, map(_INPUTS, seqs))) == {1} and max(map(len, map(_BLOCKS, seqs))) <= self.self_width
                and max(map(len, map(_CROSS, seqs))) <= self.cross_width)

    def run(self, seqs, fill: list[list[int]] | None = None, prev_tokens: torch.Tensor | None = None,
            replay: bool = True):
        """Copy the step's inputs into the static buffers and replay; ``fill`` ([rows, previous-sample
        rows]) names the rows whose token is taken from ``prev_tokens`` on the device."""
        n = len(seqs)
        host64, host32 = self._staging[self._turn]
        held = self._held[self._turn]
        self._turn ^= 1
        B = self.max_b
        fill_staging(host64.numpy(), host32.numpy(), seqs, B, self.tpb, self.self_width, self.cross_width, fill,
                     held)
        self._dev64.copy_(host64, non_blocking=True)
        self._dev32.copy_(host32, non_blocking=True)
        if fill is not None:            # the rows travelled in the same copy: no allocation, no second copy
            k = len(fill[0])
            # index_copy_ / index_select: what the advanced-index assignment becomes, a few
            # microseconds of dispatch fewer on the engine thread
            self._dev64[:B].index_copy_(0, self._dev64[4 * B:4 * B + k],
                                        prev_tokens.index_select(0, self._dev64[5 * B:5 * B + k]))
        if not replay:
            return None
        b = next(size for size in self.sizes if size >= n)
        self.graphs[b].replay()
        return self.logits[b][:n]


def scatter_rows(table: np.ndarray, rows: list[list[int]], row_ids: np.ndarray | None = None) -> None:
    """table[i, :len(rows[i])] = rows[i] for every i (or table[row_ids[i], ...]), in a few numpy calls."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lens.sum())
    if total == 0:
        return
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    row_idx = np.repeat(np.arange(len(rows)) if row_ids is None else row_ids, lens)
    col_idx = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    table[row_idx, col_idx] = flat


def scatter_changed_rows(table: np.ndarray, rows: list[list[int]], held: list) -> None:
    """``scatter_rows`` (with zero padding) for a table that already holds the lists in ``held``,
    row by row, from an earlier call: only the rows whose list is not the same object are written,
    and rows past ``len(rows)`` that held one are zeroed. ``held`` is updated in place.

    Sound because the scheduler replaces a sequence's block lists, never mutates them (a growing
    table is a new list; see ``Scheduler._emit_seqs``). A decode step then rewrites only the rows of
    new sequences and of those that crossed into a new block, instead of every row: Whisper's cross
    table alone is 64 x 94 entries a step at C=64."""
    n, k = len(rows), len(held)
    changed = [i for i, (r, h) in enumerate(zip(rows, held)) if r is not h]
    if n > k:
        changed += range(k, n)
    elif k > n:
        table[n:k] = 0
    if changed:
        ids = np.array(changed, dtype=np.int64)
        table[ids] = 0
        scatter_rows(table, [rows[i] for i in changed], ids)
    held[:] = rows


def fill_staging(h64: np.ndarray, h32: np.ndarray, seqs, B: int, tpb: int, self_width: int,
                 cross_width: int, fill: list[list[int]] | None = None,
                 held: tuple[list, list] | None = None) -> None:
    """Write one decode step's inputs into the staging layout of ``DecodeGraphRunner``.

    h64 (int64, 6 * B): input ids | positions | self slots | last-token rows | the rows whose
    input is a placeholder (``fill[0]``) | the previous step's sample rows they take (``fill[1]``).
    h32 (int32): query_start_loc (B + 1) | seq_lens (B) | enc_lens (B) | self block table
    (B x self_width) | cross block table (B x cross_width). Rows past ``len(seqs)`` are
    padding: slot -1 (write nowhere), one key and one encoder position, block 0.
    Every sequence feeds one token (``can_run``). Vectorised: the per-sequence work is one
    map() per field read, the rest numpy, which matters at large batch where the host must
    stay ahead of a ~2 ms GPU step. ``held``: the (self, cross) block lists the tables of these
    buffers hold from their last call (``scatter_changed_rows``), updated; None rewrites both.
    """
    n = len(seqs)
    h64[:] = 0
    h64[2 * B:3 * B] = -1
    h64[3 * B:4 * B] = np.arange(B)
    h32[:B + 1] = np.arange(B + 1)
    h32[B + 1:3 * B + 1] = 1
    o_bt = 3 * B + 1
    o_cbt = o_bt + B * self_width
    bt = h32[o_bt:o_cbt].reshape(B, self_width)
    cbt = h32[o_cbt:o_cbt + B * cross_width].reshape(B, cross_width)
    if held is None:            # no record of what the tables hold: clear them, write every row
        h32[o_bt:] = 0
        held = ([], [])
    scatter_changed_rows(bt, list(map(_BLOCKS, seqs)), held[0])
    scatter_changed_rows(cbt, list(map(_CROSS, seqs)), held[1])
    if fill is not None:
        k = len(fill[0])
        h64[4 * B:4 * B + k] = fill[0]
        h64[5 * B:5 * B + k] = fill[1]
    if n == 0:
        return
    pos = np.fromiter(map(_START, seqs), np.int64, n)
    h64[:n] = np.fromiter(map(_FIRST, map(_INPUTS, seqs)), np.int64, n)
    h64[B:B + n] = pos
    h32[B + 1:B + 1 + n] = pos + 1                    # seq_len: one token fed
    h32[2 * B + 1:2 * B + 1 + n] = np.fromiter(map(_ENC_LEN, seqs), np.int64, n)
    h64[2 * B:2 * B + n] = bt[np.arange(n), pos // tpb].astype(np.int64) * tpb + pos % tpb   # self slots


def uniform_encoder_batch(batch: int, length: int, device: torch.device, dtype: torch.dtype,
                          whisper_mels: int | None = None, padded: bool = False
                          ) -> tuple[torch.Tensor, EncoderMetadata]:
    """``batch`` zero inputs of ``length`` encoder positions each, with their metadata: token ids
    ``[batch * length]``, or Whisper features ``[batch, whisper_mels, 2 * length]`` (two frames
    per position). Every cross slot is -1. ``padded``: text lengths as the device tensor
    ``padded_lens`` (ones; the padded layout of the encoder graphs)."""
    if whisper_mels is not None:
        inputs = torch.zeros(batch, whisper_mels, 2 * length, dtype=dtype, device=device)
        positions = None
    else:
        inputs = torch.zeros(batch * length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).repeat(batch)
    meta = EncoderMetadata(
        cu_seqlens=torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device),
        seq_lens=[length] * batch, positions=positions,
        cross_slot_mapping=torch.full((batch * length,), -1, dtype=torch.long, device=device),
        padded_lens=(torch.ones(batch, dtype=torch.int32, device=device)
                     if padded and whisper_mels is None else None))
    return inputs, meta


def encoder_buckets(cfg, max_batch: int, max_tokens: int, max_len: int, fixed_len: int | None = None
                    ) -> list[tuple[int, int]]:
    """The (batch, length) buckets to capture: ``cfg.batch_sizes`` (default the powers of two
    and the cap's batch of longest inputs) up to ``max_batch``, ``cfg.seq_lens`` (default 64,
    128 ... up to ``max_len``, which is always included) or the model's one ``fixed_len``, and at
    most ``max_tokens`` (and ``max(cfg.num_tokens)``, when given) padded tokens per bucket."""
    cap = min(max_tokens, max(cfg.num_tokens)) if cfg.num_tokens else max_tokens
    longest = fixed_len or max_len
    # Every power of two the token cap admits at some length: a wave of short requests fills a
    # whole step's budget (64 of 128 tokens at 8192), and one larger than the largest graph
    # encodes eagerly, on the main stream, at the host's launch rate. By default also the largest
    # batch of the longest inputs (Whisper at 8192 tokens encodes 5 clips a step, which no power
    # of two holds).
    powers = {1 << i for i in range(max(1, max_batch).bit_length())}
    grid = cfg.batch_sizes or sorted(powers | ({cap // longest} if cap >= longest else set()))
    batches = [b for b in grid if b <= max_batch]
    if fixed_len is not None:
        lens = [fixed_len]
    elif cfg.seq_lens:
        lens = [n for n in cfg.seq_lens if n <= max_len]
    else:
        lens = sorted({n for n in (64 << i for i in range(12)) if n < max_len} | {max_len})
    return sorted((b, n) for b in batches for n in lens if b * n <= cap)


class EncoderGraphRunner:
    def __init__(self, model, kv, device, buckets: list[tuple[int, int]], tokens_per_block: int,
                 pad_batch: bool, whisper_mels: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 capture_stream: torch.cuda.Stream | None = None):
        self.model, self.kv, self.device = model, kv, device
        # A graph keeps the cuBLAS workspace of the stream it was captured on, and every graph
        # captured on torch's default capture stream shares one. An encoder graph replayed on the
        # encoder stream while a decoder graph replays on the main stream must not share it:
        # cuBLAS's split-K GEMMs keep partial sums and arrival flags there, and two such GEMMs
        # at once hung flan-t5-large on the H200 (docs/benchmarks.md, Run R). So the encoder
        # graphs are captured (and warmed up) on the stream they replay on, when there is one.
        self.capture_stream = capture_stream
        self.tpb = tokens_per_block
        self.pad_batch = pad_batch
        self.whisper_mels, self.dtype = whisper_mels, dtype
        self.buckets = sorted(buckets, key=lambda bl: (bl[0] * bl[1], bl[0]))     # cheapest first
        self.static: dict[tuple[int, int], tuple[torch.Tensor, EncoderMetadata]] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        for b, n in self.buckets:
            self.static[(b, n)] = uniform_encoder_batch(b, n, device, dtype, whisper_mels, padded=True)

    def _forward(self, inputs: torch.Tensor, meta: EncoderMetadata) -> None:
        self.model.write_cross_kv(self.model.encode(inputs, meta), meta, self.kv)

    def capture(self) -> None:
        t0 = time.perf_counter()
        warm_stream = self.capture_stream or torch.cuda.current_stream(self.device)
        for bucket in sorted(self.buckets, key=lambda bl: -bl[0] * bl[1]):    # largest first: one pool
            inputs, meta = self.static[bucket]
            torch.cuda.synchronize(self.device)
            with torch.cuda.stream(warm_stream):
                for _ in range(2):                 # warm up: kernels compile, the bias table is built
                    self._forward(inputs, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                # A fresh metadata object: the backend caches per-batch masks by identity, and
                # the captured graph must rebuild them from the static lengths at every replay.
                self._forward(inputs, dataclasses.replace(meta))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d encoder CUDA graphs ((batch, length) %s) in %.1f s", len(self.graphs),
                    " ".join(f"{b}x{n}" for b, n in self.buckets), time.perf_counter() - t0)

    def pick(self, encodes) -> tuple[int, int] | None:
        """The cheapest bucket holding this batch (batch padded only with ``pad_batch``)."""
        return self.bucket_for(len(encodes), max(e.encoder_len for e in encodes))

    def bucket_for(self, count: int, longest: int) -> tuple[int, int] | None:
        """The cheapest bucket holding ``count`` inputs of at most ``longest`` positions."""
        for b, n in self.buckets:
            if (b >= count if self.pad_batch else b == count) and n >= longest:
                return b, n
        return None

    def positions(self, count: int, longest: int) -> int | None:
        """Encoder positions (padding included) of the graph that would run ``count`` inputs of at
        most ``longest`` positions; None when no graph holds them."""
        bucket = self.bucket_for(count, longest)
        return None if bucket is None else bucket[0] * bucket[1]

    def run(self, encodes, bucket: tuple[int, int], features: torch.Tensor | None = None,
            replay: bool = True) -> None:
        """Lay ``encodes`` out in ``bucket``'s static buffers and replay its graph (Whisper:
        ``features`` [count, n_mels, frames] already on the device)."""
        b, n = bucket
        inputs, meta = self.static[bucket]
        slots = np.full(b * n, -1, dtype=np.int64)
        for i, e in enumerate(encodes):
            slots[i * n:i * n + e.encoder_len] = slot_ids(e.cross_block_ids, 0, e.encoder_len, self.tpb)
        meta.cross_slot_mapping.copy_(to_device(slots, torch.long, self.device), non_blocking=True)
        if features is not None:
            inputs[:len(encodes)].copy_(features)
        else:
            ids = np.zeros(b * n, dtype=np.int64)
            lens = np.ones(b, dtype=np.int32)
            for i, e in enumerate(encodes):
                ids[i * n:i * n + e.encoder_len] = e.encoder_input
                lens[i] = e.encoder_len
            inputs.copy_(to_device(ids, torch.long, self.device), non_blocking=True)
            meta.padded_lens.copy_(to_device(lens, torch.int32, self.device), non_blocking=True)
        if replay:
            self.graphs[bucket].replay()
        else:                                       # eager over the same buffers (CPU tests)
            self._forward(inputs, dataclasses.replace(meta))

    def release(self) -> None:
        """Destroy the graphs (before any NCCL communicator they captured closes)."""
        _destroy(self.graphs, self.device)
        self.pool = None


def _destroy(graphs: dict, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    for graph in graphs.values():
        graph.reset()
    graphs.clear()
