"""Long audio with a 30 s model: window plans, timestamp parsing and chunk merging.

Token ids, seconds and numpy (no torch, no engine), so every rule here is unit tested
with hand-made token lists and synthetic signals.

Two strategies (docs/transcribe.md compares them):
- sequential: decode a 30 s window with timestamp tokens, keep the segments that closed,
  move the window to the end of the last closed segment, repeat. One window at a time per
  file, so a file decodes serially; the most accurate (no cut words, no merge).
- chunked: windows that overlap by about ``CHUNK_OVERLAP_S`` (each start moved into the
  nearest pause), all decoded at once, then stitched where the token sequences of
  neighbouring windows agree inside the overlap.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import numpy as np

from enc2dec.engine.whisper.tokens import TIME_PRECISION_S

WINDOW_S = 30.0
CHUNK_OVERLAP_S = 5.0
CHUNK_SEARCH_S = 2.0       # how far a chunk start may move to land in a pause
MIN_WINDOW_S = 0.1        # shorter tails are not decoded (nothing to hear, easy to hallucinate on)


@dataclass
class Piece:
    """Text tokens between two timestamps, in seconds from the start of the file."""

    start_s: float
    end_s: float
    token_ids: list[int]


@dataclass
class WindowResult:
    pieces: list[Piece]
    consumed_s: float           # how far the next sequential window may start from this one's start


@dataclass
class _Item:                    # one text token of a chunk, and the piece it belongs to
    token_id: int
    piece: int


@dataclass
class Merged:
    """Chunks stitched so far: text tokens, each pointing into ``pieces``."""

    items: list[_Item] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)


# ---- window plans ---------------------------------------------------------------------------
def frame_loudness(wave: np.ndarray, sample_rate: int, frame_s: float = 0.02, smooth_s: float = 0.2) -> np.ndarray:
    """Mean power per ``frame_s`` frame, smoothed over ``smooth_s``: [num_frames]."""
    frame = max(1, int(round(frame_s * sample_rate)))
    n = len(wave) // frame
    if n == 0:
        return np.zeros(1, dtype=np.float32)
    power = np.square(wave[:n * frame].astype(np.float32)).reshape(n, frame).mean(axis=1)   # [n]
    width = max(1, int(round(smooth_s / frame_s)))
    return np.convolve(power, np.ones(width, dtype=np.float32) / width, mode="same")


def chunk_windows(wave: np.ndarray, sample_rate: int, window_s: float = WINDOW_S,
                  overlap_s: float = CHUNK_OVERLAP_S, search_s: float = CHUNK_SEARCH_S) -> list[tuple[int, int]]:
    """(start, end) sample ranges of overlapping windows covering the audio. Each window
    after the first starts at the quietest point within ``search_s`` of where an overlap of
    ``overlap_s`` would put it: a window that opens mid-sentence makes Whisper skip the
    partial words and misplace every timestamp after them, one that opens in a pause does not."""
    n, window = len(wave), int(round(window_s * sample_rate))
    if n <= window:
        return [(0, n)]
    frame = int(round(0.02 * sample_rate))
    loud = frame_loudness(wave, sample_rate)
    spans, start = [], 0
    while True:
        end = min(start + window, n)
        spans.append((start, end))
        if end >= n:
            return spans
        lo = max(start + frame, end - int(round((overlap_s + search_s) * sample_rate)))
        hi = max(lo + frame, end - int(round(max(overlap_s - search_s, 0.5) * sample_rate)))
        f_lo, f_hi = lo // frame, min(max(hi // frame, lo // frame + 1), len(loud))
        start = (f_lo + int(np.argmin(loud[f_lo:f_hi]))) * frame if f_lo < len(loud) else lo


# ---- one window's tokens -> timed pieces ------------------------------------------------------
def parse_window(token_ids: list[int], eot: int, timestamp_begin: int, start_s: float, length_s: float,
                 timestamps: bool) -> WindowResult:
    """Split a window's output into pieces. With timestamps: pieces closed by a timestamp
    pair, plus the open tail (it ends at the window's end); ``consumed_s`` is where the last
    closed piece ended, or the whole window when the text ended with a lone timestamp (the
    speech ran to the end) or held no pair at all."""
    ids = [t for t in token_ids if t != eot]
    end_s = start_s + length_s
    if not timestamps:
        text = [t for t in ids if t < eot]
        return WindowResult([Piece(start_s, end_s, text)] if text else [], length_s)

    def at(t: int) -> float:
        return min(start_s + (t - timestamp_begin) * TIME_PRECISION_S, end_s)

    is_ts = [t >= timestamp_begin for t in ids]
    pair_ends = [i for i in range(1, len(ids)) if is_ts[i] and is_ts[i - 1]]
    lone_ending = len(ids) >= 2 and is_ts[-1] and not is_ts[-2]
    pieces: list[Piece] = []
    cut = 0
    for i in pair_ends + ([len(ids)] if lone_ending else []):
        span = ids[cut:i]           # starts and ends with a timestamp
        text = [t for t in span if t < eot]
        if text:
            pieces.append(Piece(at(span[0]), at(span[-1]), text))
        cut = i
    tail = [t for t in ids[cut:] if t < eot]
    if tail:                    # an open piece: no closing timestamp, it runs to the window's end
        pieces.append(Piece(at(ids[cut]) if is_ts[cut] else start_s, end_s, tail))
    consumed = length_s
    if pair_ends and not lone_ending:
        consumed = (ids[pair_ends[-1] - 1] - timestamp_begin) * TIME_PRECISION_S
        if not 0 < consumed <= length_s:    # never stall, never skip past the window
            consumed = length_s
    return WindowResult(pieces, consumed)


def closed_pieces(result: WindowResult, start_s: float) -> list[Piece]:
    """The pieces that end at or before the point the next sequential window starts from."""
    limit = start_s + result.consumed_s + 1e-6
    return [p for p in result.pieces if p.end_s <= limit]


# ---- stitching chunks ----------------------------------------------------------------------
def _search_len(num_tokens: int, overlap_s: float, length_s: float) -> int:
    # Tokens that can fall inside the overlap: its share of the window, with slack for
    # uneven speech rates.
    return min(num_tokens, max(8, math.ceil(num_tokens * 1.5 * overlap_s / max(length_s, 1e-6)) + 4))


def merge_chunk(merged: Merged, pieces: list[Piece], overlap_s: float, prev_len: tuple[int, float],
                length_s: float, min_match: int = 2) -> None:
    """Append one chunk's pieces to ``merged``. The splice point is the middle of the longest
    run of tokens that the end of the previous chunk and the start of this one share
    (searched only near the overlap, so repeated phrases elsewhere cannot match). Without
    such a run (silence in the overlap, or the two decodes disagree) both are kept whole."""
    items = [_Item(t, len(merged.pieces) + k) for k, p in enumerate(pieces) for t in p.token_ids]
    new_pieces = [Piece(p.start_s, p.end_s, []) for p in pieces]
    prev_tokens, prev_length_s = prev_len
    if merged.items and items and overlap_s > 0:
        n_left = _search_len(prev_tokens, overlap_s, prev_length_s)
        n_right = _search_len(len(items), overlap_s, length_s)
        left0 = len(merged.items) - n_left
        left = [it.token_id for it in merged.items[left0:]]
        right = [it.token_id for it in items[:n_right]]
        m = difflib.SequenceMatcher(None, left, right, autojunk=False).find_longest_match(
            0, len(left), 0, len(right))
        if m.size >= min_match:
            cut_left = left0 + m.a + m.size // 2
            cut_right = m.b + m.size // 2
            left_piece = merged.items[cut_left - 1].piece if cut_left > 0 else None
            right_piece = items[cut_right].piece if cut_right < len(items) else None
            del merged.items[cut_left:]
            items = items[cut_right:]
            if left_piece is not None and right_piece is not None:
                # The piece cut in two becomes one: its start from the left, its end from the right.
                merged.pieces[left_piece].end_s = new_pieces[right_piece - len(merged.pieces)].end_s
                items = [_Item(it.token_id, left_piece if it.piece == right_piece else it.piece) for it in items]
    merged.pieces.extend(new_pieces)
    merged.items.extend(items)


def merged_pieces(merged: Merged) -> list[Piece]:
    """The stitched pieces in order, each holding the tokens that survived the splices."""
    out: dict[int, Piece] = {}
    for it in merged.items:
        src = merged.pieces[it.piece]
        out.setdefault(it.piece, Piece(src.start_s, src.end_s, [])).token_ids.append(it.token_id)
    return list(out.values())


def monotonic(pieces: list[Piece], duration_s: float) -> list[Piece]:
    """Clamp times into [0, duration] and make them non-decreasing (the model may round a
    boundary either way; stitched chunks may overlap by a few hundredths)."""
    out, last = [], 0.0
    for p in pieces:
        start = min(max(p.start_s, last, 0.0), duration_s)
        end = min(max(p.end_s, start), duration_s)
        out.append(Piece(start, end, p.token_ids))
        last = end
    return out
