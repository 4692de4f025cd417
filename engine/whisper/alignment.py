"""Word-level timestamps: where each decoded word is spoken, from the cross-attention of the
checkpoint's alignment heads, as the original Whisper finds them.

For a window of audio and the text decoded from it, the decoder is run once more over
``prefix + <|notimestamps|> + text + <|endoftext|>`` with the engine's own weights; the
attention of the alignment heads (``generation_config.alignment_heads``; without them every
head of the decoder's last half) over the window's encoder frames is softmaxed, normalised
per frame over the tokens, median-filtered along time and averaged over heads. A monotone
path through that matrix (DTW) gives each token the frame where its attention starts;
tokens are grouped into words (on spaces, or on whole characters for languages written
without them) and punctuation joins its word. Probability: the mean of the word's token
probabilities in that same forward pass.

The forward pass runs on the engine thread between two steps (``LLM.call_on_engine``), for
a batch of windows at once and no larger than an encoder microbatch the engine admits (its
activations were kept out of the KV pools at start-up); DTW and the word rules run on the
host in the caller's thread. Nothing here runs unless word timestamps are asked for.
"""
from __future__ import annotations

import asyncio
import functools
import string
from dataclasses import dataclass

import numpy as np

from enc2dec.engine.whisper.results import Segment, Word

WINDOW_S = 30.0
FRAMES_PER_S = 50                 # encoder positions per second of audio (1500 per 30 s)
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = ".。!！?？"
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
LEAD_S = 1.0                      # audio kept before a window's first segment when a gap forces a new start


@dataclass
class AlignWindow:
    """One alignment request: ``samples`` (at most 30 s) and the text decoded from them."""

    samples: np.ndarray
    offset_s: float                  # where ``samples`` start in the file
    prefix: list[int]                # <|startoftranscript|> [language, task] <|notimestamps|>
    text_ids: list[int]
    num_frames: int                  # encoder positions the real audio fills (1500 for 30 s)


@dataclass
class _Timing:                       # a word while the rules move its edges
    word: str
    tokens: list[int]
    start_s: float
    end_s: float
    probs: list[float]


def alignment_heads(generation_config, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs; the original Whisper's fallback when the checkpoint names none."""
    heads = getattr(generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    return [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


# ---- on the engine thread -------------------------------------------------------------------
def attention_batch(core, windows: list[AlignWindow], heads: list[tuple[int, int]], eot: int):
    """Per window: the normalised, filtered alignment matrix ``[num_text + 1, num_frames]``
    (row 0 predicts the first text token) and the text tokens' probabilities ``[num_text]``,
    as float64 NumPy arrays. Runs ``fn(core)``-style on the engine thread."""
    import torch

    with torch.inference_mode():
        model = core.runner.model
        enc = _encode(core, model, [w.samples for w in windows])                  # [B, 1500, d]
        seqs = [w.prefix + w.text_ids + [eot] for w in windows]
        hidden, scores = _decode(model, enc, seqs, heads, eot)                    # [B, T, d], [B, h, T, 1500]
        out = []
        for b, (w, seq) in enumerate(zip(windows, seqs)):
            rows = slice(len(w.prefix) - 1, len(w.prefix) - 1 + len(w.text_ids))
            logits = model.compute_logits(hidden[b, rows])[:, :eot]               # [n, eot] float32
            ids = torch.tensor(w.text_ids, device=logits.device)
            probs = logits.softmax(-1).gather(1, ids[:, None])[:, 0]
            matrix = _normalise(scores[b, :, :len(seq), :w.num_frames])           # [T_b, frames]
            out.append((matrix[len(w.prefix) - 1:len(seq) - 1].double().cpu().numpy(),
                        probs.double().cpu().numpy()))
        return out


def _encode(core, model, waves: list[np.ndarray]):
    import torch

    from enc2dec.engine.models.attention import EncoderMetadata

    proc, dev = core.processor, core.device
    if proc.log_mel is not None:       # GPU: the engine's batched log-mel
        feats = proc.log_mel(proc.log_mel.batch(waves).to(dev))
    else:
        fe = proc.feature_extractor
        feats = torch.as_tensor(np.stack([fe(w, sampling_rate=fe.sampling_rate, return_tensors="np")
                                          .input_features[0] for w in waves]), device=dev)
    feats = feats.to(core.dtype)                                                  # [B, n_mels, 3000]
    n = model.max_encoder_positions
    meta = EncoderMetadata(cu_seqlens=torch.arange(0, (len(waves) + 1) * n, n, dtype=torch.int32, device=dev),
                           seq_lens=[n] * len(waves), positions=None,
                           cross_slot_mapping=torch.empty(0, dtype=torch.long, device=dev))
    return model.encode(feats, meta).view(len(waves), n, -1)


def _decode(model, enc, seqs: list[list[int]], heads: list[tuple[int, int]], pad_id: int):
    """A dense decoder pass over whole sequences (right-padded: causal attention keeps the
    padding out of the real rows), returning the last hidden states and the raw
    cross-attention scores of the alignment heads, in ``heads`` order."""
    import torch
    import torch.nn.functional as F

    dec = model.decoder
    num_t = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (num_t - len(s)) for s in seqs], device=enc.device)    # [B, T]
    h = model.embed_tokens(ids) + dec.embed_positions.weight[:num_t]                           # [B, T, d]
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    scores = {}
    for i, layer in enumerate(dec.layers):
        sa, ca = layer.self_attn, layer.encoder_attn
        q, k, v = _heads(F.linear(_norm(layer.self_attn_layer_norm, h), sa.qkv.weight, sa.qkv.bias), 3, sa)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sa.scale)           # [B, H, T, D]
        h = h + F.linear(_merge(o), sa.out_proj.weight, sa.out_proj.bias)
        (q,) = _heads(F.linear(_norm(layer.encoder_attn_layer_norm, h), ca.q_proj.weight, ca.q_proj.bias), 1, ca)
        k, v = _heads(F.linear(enc, ca.kv.weight, ca.kv.bias), 2, ca)                           # [B, H, 1500, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=ca.scale)
        h = h + F.linear(_merge(o), ca.out_proj.weight, ca.out_proj.bias)
        if i in by_layer:
            sel = by_layer[i]
            scores[i] = (q[:, sel].float() @ k[:, sel].float().transpose(-1, -2)) * ca.scale    # [B, h, T, 1500]
        mlp = layer.mlp
        x = F.linear(_norm(layer.final_layer_norm, h), mlp.fc1.weight, mlp.fc1.bias)
        h = h + F.linear(mlp.act(x), mlp.fc2.weight, mlp.fc2.bias)
    order = {layer: iter(range(len(hs))) for layer, hs in by_layer.items()}
    picked = [scores[layer][:, next(order[layer])] for layer, _ in heads]
    return _norm(dec.layer_norm, h), torch.stack(picked, dim=1)


def _norm(ln, x):
    import torch.nn.functional as F

    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _heads(x, num: int, attn):
    # [B, T, num * H * D] -> num x [B, H, T, D]
    b, t, _ = x.shape
    return x.view(b, t, num, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def _merge(o):
    b, heads, t, d = o.shape
    return o.transpose(1, 2).reshape(b, t, heads * d)


def _normalise(scores):
    """[heads, T, frames] raw scores -> [T, frames]: softmax over the real frames, each frame
    standardised over the tokens, a median filter along time, the mean over heads."""
    import torch
    import torch.nn.functional as F

    w = scores.softmax(dim=-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = (w - mean) / std
    half = MEDIAN_FILTER_WIDTH // 2
    if w.shape[-1] > half:
        w = F.pad(w, (half, half), mode="reflect")                          # [heads, T, frames + 2 * half]
        w = w.unfold(-1, MEDIAN_FILTER_WIDTH, 1).sort(dim=-1).values[..., half]
    return w.mean(dim=0)


# ---- on the host ----------------------------------------------------------------------------
def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through ``cost`` [N, M] from (0, 0) to (N-1, M-1), moving
    diagonally, down a row or along a column: (row indices, column indices). Each row's
    accumulated cost is one cumulative-minimum scan (``c_j = x_j + min(a_j, c_{j-1})`` unrolls
    to ``S_j + min_{k<=j}(a_k - S_{k-1})``), so the loop runs over rows, not cells."""
    num_rows, num_cols = cost.shape
    acc = np.full((num_rows + 1, num_cols + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, num_rows + 1):
        entry = np.minimum(acc[i - 1, :-1], acc[i - 1, 1:])          # [M]: from the diagonal or above
        total = np.cumsum(cost[i - 1])                                # [M]
        acc[i, 1:] = total + np.minimum.accumulate(entry - np.concatenate(([0.0], total[:-1])))
    i, j, path = num_rows, num_cols, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        if i == 0:
            j -= 1
        elif j == 0:
            i -= 1
        else:
            diag, up, left = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
            if diag < up and diag < left:
                i, j = i - 1, j - 1
            elif up < diag and up < left:
                i -= 1
            else:
                j -= 1
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def split_words(ids: list[int], decode, language: str | None) -> tuple[list[str], list[list[int]]]:
    """Text tokens -> words with their tokens: whole characters for languages written without
    spaces, else a new word at each leading space or punctuation mark."""
    pieces, groups = _split_on_characters(ids, decode)
    if language in NO_SPACE_LANGUAGES:
        return pieces, groups
    words: list[str] = []
    word_ids: list[list[int]] = []
    for piece, group in zip(pieces, groups):
        if not words or piece.startswith(" ") or piece.strip() in string.punctuation:
            words.append(piece)
            word_ids.append(list(group))
        else:
            words[-1] += piece
            word_ids[-1] += group
    return words, word_ids


def _split_on_characters(ids: list[int], decode) -> tuple[list[str], list[list[int]]]:
    # A token that ends inside a multi-byte character decodes to U+FFFD: keep adding tokens
    # until the character is whole (unless the text really holds a U+FFFD there).
    full = decode(ids)
    pieces, groups, current, offset = [], [], [], 0
    for t in ids:
        current.append(t)
        text = decode(current)
        bad = text.find("\ufffd")
        if bad < 0 or full[offset + bad:offset + bad + 1] == "\ufffd":
            pieces.append(text)
            groups.append(current)
            current, offset = [], offset + len(text)
    if current:
        pieces.append(decode(current))
        groups.append(current)
    return pieces, groups


def window_words(matrix: np.ndarray, probs: np.ndarray, window: AlignWindow, decode,
                 language: str | None) -> list[_Timing]:
    """The words of one window, in file seconds, before the boundary rules."""
    if not window.text_ids:
        return []
    rows, cols = dtw_path(-matrix)
    jumps = np.diff(rows, prepend=-1).astype(bool)
    starts = cols[jumps] / FRAMES_PER_S                     # [num_text + 1]: where each row's path begins
    words, groups = split_words(window.text_ids, decode, language)
    bounds = np.concatenate(([0], np.cumsum([len(g) for g in groups])))
    return [_Timing(w, g, window.offset_s + float(starts[a]), window.offset_s + float(starts[b]),
                    probs[a:b].tolist())
            for w, g, a, b in zip(words, groups, bounds[:-1], bounds[1:])]


def _median_and_max(timings: list[_Timing]) -> tuple[float, float]:
    durations = np.array([t.end_s - t.start_s for t in timings])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    return median, 2 * median


def _cap_sentence_ends(timings: list[_Timing], max_s: float) -> None:
    # A pause after a sentence tends to be swallowed by its last word or the next one.
    for prev, t in zip(timings, timings[1:]):
        if t.end_s - t.start_s > max_s:
            if t.word in SENTENCE_END:
                t.end_s = t.start_s + max_s
            elif prev.word in SENTENCE_END:
                t.start_s = t.end_s - max_s


def merge_punctuation(timings: list[_Timing]) -> None:
    """Opening marks join the word after them, closing marks the word before (the original's
    sets and order); a merged-away entry keeps its place with no text and no tokens."""
    j = len(timings) - 1
    for i in range(len(timings) - 2, -1, -1):
        prev, nxt = timings[i], timings[j]
        if prev.word.startswith(" ") and prev.word.strip() in PREPEND_PUNCTUATION:
            nxt.word, nxt.tokens, nxt.probs = prev.word + nxt.word, prev.tokens + nxt.tokens, prev.probs + nxt.probs
            prev.word, prev.tokens, prev.probs = "", [], []
        else:
            j = i
    i = 0
    for j in range(1, len(timings)):
        prev, nxt = timings[i], timings[j]
        if not prev.word.endswith(" ") and nxt.word in APPEND_PUNCTUATION:
            prev.word, prev.tokens, prev.probs = prev.word + nxt.word, prev.tokens + nxt.tokens, prev.probs + nxt.probs
            nxt.word, nxt.tokens, nxt.probs = "", [], []
        else:
            i = j


def segment_words(timings: list[_Timing], pieces, texts: list[str], last_speech_s: float):
    """Split one window's words among its pieces (by token counts) and apply the original's
    boundary rules: a first word after a pause and the edge words of a segment may not run
    much longer than the median word. Returns ``(segments, last speech end)``."""
    median_s, max_s = _median_and_max(timings)
    if median_s > 0:
        _cap_sentence_ends(timings, max_s)
    merge_punctuation(timings)
    segments, k = [], 0
    for piece, text in zip(pieces, texts):
        words, num_tokens = [], 0
        while k < len(timings) and num_tokens < len(piece.token_ids):
            t = timings[k]
            if t.word:
                words.append(t)
            num_tokens += len(t.tokens)
            k += 1
        if words:
            _fit_edges(words, piece.start_s, piece.end_s, last_speech_s, median_s, max_s)
            last_speech_s = words[-1].end_s
        if text:
            segments.append(Segment(piece.start_s, piece.end_s, text, words=tuple(
                Word(w.word, w.start_s, w.end_s, round(float(np.mean(w.probs)), 4) if w.probs else 0.0)
                for w in words)))
    return segments, last_speech_s


def monotone(segments: list[Segment]) -> list[Segment]:
    """Words in order (each start at or after the previous end) and every segment spanning
    exactly its words, so words never fall outside their segment nor segments overlap."""
    out, last = [], 0.0
    for seg in segments:
        words = []
        for w in seg.words:
            start = round(max(w.start_s, last), 3)
            end = round(max(w.end_s, start), 3)
            words.append(w._replace(start_s=start, end_s=end))
            last = end
        if words:
            out.append(seg._replace(start_s=words[0].start_s, end_s=words[-1].end_s, words=tuple(words)))
        else:
            start = round(max(seg.start_s, last), 3)
            last = round(max(seg.end_s, start), 3)
            out.append(seg._replace(start_s=start, end_s=last))
    return out


def _fit_edges(words: list[_Timing], start_s: float, end_s: float, last_speech_s: float, median_s: float,
               max_s: float) -> None:
    """The original's edge rules (the segment's own bounds then follow its words, ``monotone``)."""
    first, last = words[0], words[-1]
    if first.end_s - last_speech_s > 4 * median_s and (
            first.end_s - first.start_s > max_s or (len(words) > 1 and words[1].end_s - first.start_s > 2 * max_s)):
        if len(words) > 1 and words[1].end_s - words[1].start_s > max_s:
            first.end_s = words[1].start_s = max(words[1].end_s / 2, words[1].end_s - max_s)
        first.start_s = max(0.0, first.end_s - max_s)
    if start_s < first.end_s and start_s - 0.5 > first.start_s:      # the first word is too long
        first.start_s = max(0.0, min(first.end_s - median_s, start_s))
    if end_s > last.start_s and end_s + 0.5 < last.end_s:            # the last word is too long
        last.end_s = max(last.start_s + median_s, end_s)


# ---- planning and the async front ------------------------------------------------------------
def plan_windows(pieces, duration_s: float) -> list[tuple[float, float, list[int]]]:
    """Group consecutive pieces into alignment windows of at most 30 s: ``(start_s, end_s,
    piece indices)``. A window starts where the previous one's last piece ended (the audio the
    model heard after it), or shortly before its first piece when that would not fit."""
    plans, i, prev_end = [], 0, 0.0
    while i < len(pieces):
        first = pieces[i]
        start = prev_end
        if first.end_s - start > WINDOW_S:
            start = max(prev_end, first.start_s - LEAD_S)
        end = min(start + WINDOW_S, duration_s)
        members = [i]
        i += 1
        while i < len(pieces) and pieces[i].end_s <= end:
            members.append(i)
            i += 1
        plans.append((start, end, members))
        prev_end = pieces[members[-1]].end_s
    return plans


class WordAligner:
    """Adds words to a run's transcripts. Windows asked for while a batch is on the engine
    wait and go together in the next one, so concurrent files share alignment batches."""

    def __init__(self, llm, tokens, sample_rate: int, task: str):
        core = llm.engine
        if llm.args.tensor_parallel_size > 1:
            raise ValueError("word timestamps need tensor_parallel_size=1 (the alignment pass reads one "
                             "rank's weights)")
        cfg = core.hf_config
        self.llm, self.tokens, self.task, self.sample_rate = llm, tokens, task, sample_rate
        self.heads = alignment_heads(core.processor.gen, cfg.decoder_layers, cfg.decoder_attention_heads)
        n = core.runner.model.max_encoder_positions
        self.max_batch = max(1, min(core.limits.encoder_max_batch_size, core.limits.encoder_max_num_tokens // n))
        self._queue: list[tuple[AlignWindow, asyncio.Future]] = []
        self._draining = False

    def _decode_text(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def segments(self, wave: np.ndarray, pieces, texts: list[str], language: str | None) -> list[Segment]:
        """The segments of one file (``pieces`` with their ``texts``; empty texts are dropped)
        with their words."""
        duration_s = len(wave) / self.sample_rate
        plans = plan_windows(pieces, duration_s)
        prefix = self.tokens.prefix(language or "en", self.task, False)
        sr = self.sample_rate
        windows = []
        for a, b, members in plans:
            samples = wave[int(round(a * sr)):int(round(b * sr))]
            frames = min(int(WINDOW_S * FRAMES_PER_S), max(1, len(samples) * FRAMES_PER_S // sr))
            windows.append(AlignWindow(samples, a, prefix, [t for k in members
                                                            for t in self.tokens.text_ids(pieces[k].token_ids)],
                                       frames))
        results = await asyncio.gather(*(self._submit(w) for w in windows))
        return await asyncio.to_thread(self._words, plans, windows, results, pieces, texts, language)

    def _words(self, plans, windows, results, pieces, texts, language) -> list[Segment]:
        out, last_speech_s = [], 0.0
        for (_, _, members), window, (matrix, probs) in zip(plans, windows, results):
            timings = window_words(matrix, probs, window, self._decode_text, language)
            segs, last_speech_s = segment_words(timings, [pieces[k] for k in members],
                                                [texts[k] for k in members], last_speech_s)
            out += segs
        return monotone(out)

    async def _submit(self, window: AlignWindow):
        if not window.text_ids:
            return np.zeros((1, window.num_frames)), np.zeros(0)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((window, future))
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                call = functools.partial(attention_batch, windows=[w for w, _ in batch], heads=self.heads,
                                         eot=self.tokens.eot)
                try:
                    results = await asyncio.wrap_future(self.llm.call_on_engine(call))
                except Exception as e:  # noqa: BLE001 - every window of the batch gets the failure
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))
                    continue
                for (_, f), r in zip(batch, results):
                    if not f.done():
                        f.set_result(r)
        finally:
            self._draining = False
