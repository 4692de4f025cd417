"""Long audio with a 30 s model: window plans, timestamp parsing and chunk merging.

Token ids, seconds and numpy (no torch, no engine), so every rule here is unit tested
with hand-made token lists and synthetic signals.

Two strategies (docs/transcribe.md compares them):
- sequential: decode a 30 s window with timestamp tokens, keep the segments that closed,
  move the window to the end of the last closed segment, repeat. One window at a time per
  file, so a file decodes serially; the most accurate (no cut words, no merge).
- chunked: windows that overlap by about ``CHUNK_OVERLAP_S`` (each start moved into the
  nearest pause), all decoded at once, then stitched where the token sequences of
  neighbouring windows agree inside the overlap, at times that agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enc2dec.engine.whisper.decoding import WindowStats
from enc2dec.engine.whisper.tokens import TIME_PRECISION_S

WINDOW_S = 30.0
CHUNK_OVERLAP_S = 5.0
CHUNK_SEARCH_S = 2.0       # how far a chunk start may move to land in a pause
MIN_WINDOW_S = 0.1        # shorter tails are not decoded (nothing to hear, easy to hallucinate on)
# Stitching: how far outside the overlap a token's estimated time may lie and still be matched
# (a piece's tokens are spread evenly over it, which misplaces some by a second or so), and how
# well two windows' times for the same words agree (Whisper's timestamps are good to a few
# tenths; the estimate within a piece is coarser).
STITCH_SLACK_S = 1.0
STITCH_TOLERANCE_S = 2.5
# Whisper sometimes closes a window early and skips its last sentences (tiny.en does on about one
# window in ten). A window whose words stop this long before the audio that only it hears ends
# is decoded once more from where they stopped, as the original's seek would.
RETRY_GAP_S = 1.0


@dataclass
class Piece:
    """Text tokens between two timestamps, in seconds from the start of the file."""

    start_s: float
    end_s: float
    token_ids: list[int]
    stats: WindowStats | None = None    # of the window decode the text came from


@dataclass
class WindowResult:
    pieces: list[Piece]
    consumed_s: float           # how far the next sequential window may start from this one's start


@dataclass
class _Item:                    # one text token of a chunk, the piece it belongs to, when it was spoken
    token_id: int
    piece: int
    time_s: float


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
                 timestamps: bool, stats: WindowStats | None = None) -> WindowResult:
    """Split a window's output into pieces (each carrying ``stats``, the window's measures). With
    timestamps: pieces closed by a timestamp pair, plus the open tail (it ends at the window's
    end); ``consumed_s`` is where the last closed piece ended, or the whole window when the text
    ended with a lone timestamp (the speech ran to the end) or held no pair at all."""
    ids = [t for t in token_ids if t != eot]
    end_s = start_s + length_s
    if not timestamps:
        text = [t for t in ids if t < eot]
        return WindowResult([Piece(start_s, end_s, text, stats)] if text else [], length_s)

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
            pieces.append(Piece(at(span[0]), at(span[-1]), text, stats))
        cut = i
    tail = [t for t in ids[cut:] if t < eot]
    if tail:                    # an open piece: no closing timestamp, it runs to the window's end
        pieces.append(Piece(at(ids[cut]) if is_ts[cut] else start_s, end_s, tail, stats))
    consumed = length_s
    if pair_ends and not lone_ending:
        consumed = (ids[pair_ends[-1] - 1] - timestamp_begin) * TIME_PRECISION_S
        if not 0 < consumed <= length_s:    # never stall, never skip past the window
            consumed = length_s
    return WindowResult(pieces, consumed)


def unheard_from(pieces: list[Piece], until_s: float) -> float | None:
    """Where a window's words stop, when that is more than ``RETRY_GAP_S`` before ``until_s``
    (the end of the audio no other window hears); None when nothing is missing, or when the
    window heard no words at all (then it is silence, or noise a retry would only invent text for)."""
    if not pieces or pieces[-1].end_s >= until_s - RETRY_GAP_S:
        return None
    return pieces[-1].end_s


def closed_pieces(result: WindowResult, start_s: float) -> list[Piece]:
    """The pieces that end at or before the point the next sequential window starts from."""
    limit = start_s + result.consumed_s + 1e-6
    return [p for p in result.pieces if p.end_s <= limit]


# ---- stitching chunks ----------------------------------------------------------------------
def _items(pieces: list[Piece], first_piece: int) -> list[_Item]:
    """A chunk's text tokens, each timed by spreading its piece's tokens evenly over the piece."""
    return [_Item(t, first_piece + n, p.start_s + (k + 0.5) * (p.end_s - p.start_s) / len(p.token_ids))
            for n, p in enumerate(pieces) for k, t in enumerate(p.token_ids)]


def _agreeing_run(left: list[_Item], right: list[_Item], min_match: int) -> tuple[int, int, int] | None:
    """(start in left, start in right, length) of the longest run of equal tokens whose times
    in the two windows agree within ``STITCH_TOLERANCE_S``; ties go to the closer times. A
    phrase that recurs further apart is another utterance of it: matching it would splice out
    everything spoken between the two."""
    best, best_key = None, None
    run = [0] * (len(right) + 1)                # run[j + 1]: equal tokens ending at (i, j)
    for i, a in enumerate(left):
        prev, run = run, [0] * (len(right) + 1)
        for j, b in enumerate(right):
            if a.token_id != b.token_id:
                continue
            run[j + 1] = prev[j] + 1
            ends = i + 1 == len(left) or j + 1 == len(right) or left[i + 1].token_id != right[j + 1].token_id
            size = run[j + 1]
            if not ends or size < min_match:
                continue
            a0, b0 = i + 1 - size, j + 1 - size
            gap_s = abs(sum(it.time_s for it in left[a0:i + 1]) - sum(it.time_s for it in right[b0:j + 1])) / size
            if gap_s <= STITCH_TOLERANCE_S and (best_key is None or (size, -gap_s) > best_key):
                best, best_key = (a0, b0, size), (size, -gap_s)
    return best


def merge_chunk(merged: Merged, pieces: list[Piece], overlap: tuple[float, float], min_match: int = 2) -> None:
    """Append one chunk's pieces to ``merged``; ``overlap`` is the (start, end) in seconds of the
    audio this chunk shares with the previous one. Only tokens timed inside the overlap (give or
    take ``STITCH_SLACK_S``) take part, so nothing outside it is ever dropped. The splice point is
    the middle of the longest run of tokens the two windows share there at agreeing times; with
    no such run (silence, or two decodes that disagree) each window keeps its tokens up to the
    middle of the overlap."""
    items = _items(pieces, len(merged.pieces))
    new_pieces = [Piece(p.start_s, p.end_s, [], p.stats) for p in pieces]
    lo, hi = overlap
    if merged.items and items and hi > lo:
        left0 = len(merged.items)
        while left0 > 0 and merged.items[left0 - 1].time_s >= lo - STITCH_SLACK_S:
            left0 -= 1
        n_right = 0
        while n_right < len(items) and items[n_right].time_s <= hi + STITCH_SLACK_S:
            n_right += 1
        left, right = merged.items[left0:], items[:n_right]
        run = _agreeing_run(left, right, min_match)
        if run is not None:
            cut_left, cut_right = left0 + run[0] + run[2] // 2, run[1] + run[2] // 2
        elif left and right and left[-1].time_s >= right[0].time_s:
            # Both heard words at the same times: each keeps its own up to the middle of that stretch.
            mid = (max(lo, right[0].time_s) + min(hi, left[-1].time_s)) / 2
            cut_left = left0 + sum(it.time_s < mid for it in left)
            cut_right = sum(it.time_s < mid for it in right)
        else:           # one window heard nothing where the other heard words: nothing is doubled
            cut_left, cut_right = len(merged.items), 0
        split = (0 < cut_left < len(merged.items) and merged.items[cut_left].piece == merged.items[cut_left - 1].piece
                 or 0 < cut_right < len(items) and items[cut_right].piece == items[cut_right - 1].piece)
        del merged.items[cut_left:]
        items = items[cut_right:]
        if split and merged.items and items:
            # The piece cut in two becomes one: its start from the left, its end from the right.
            left_piece, right_piece = merged.items[-1].piece, items[0].piece
            merged.pieces[left_piece].end_s = new_pieces[right_piece - len(merged.pieces)].end_s
            items = [_Item(it.token_id, left_piece if it.piece == right_piece else it.piece, it.time_s)
                     for it in items]
    merged.pieces.extend(new_pieces)
    merged.items.extend(items)


def merged_pieces(merged: Merged) -> list[Piece]:
    """The stitched pieces in order, each holding the tokens that survived the splices."""
    out: dict[int, Piece] = {}
    for it in merged.items:
        src = merged.pieces[it.piece]
        out.setdefault(it.piece, Piece(src.start_s, src.end_s, [], src.stats)).token_ids.append(it.token_id)
    return list(out.values())


def monotonic(pieces: list[Piece], duration_s: float) -> list[Piece]:
    """Clamp times into [0, duration] and make them non-decreasing (the model may round a
    boundary either way; stitched chunks may overlap by a few hundredths)."""
    out, last = [], 0.0
    for p in pieces:
        start = min(max(p.start_s, last, 0.0), duration_s)
        end = min(max(p.end_s, start), duration_s)
        out.append(Piece(start, end, p.token_ids, p.stats))
        last = end
    return out
