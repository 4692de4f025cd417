"""The fused sampling race (``kernels/sampling.py``) against its torch reference, and
``sampling_ops.race`` as the sampler calls it: same tokens, seeded rows independent of the
batch, and draws that follow the softmax of the filtered logits.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
conftest.py before anything imports triton), where one program per row costs about 0.1 s: the cases
stay small. ``test_kernels_gpu.py`` runs the kernel compiled at serving shapes.
"""
import importlib.util

import numpy as np
import pytest
import torch

from enc2dec.engine.runner import sampling_ops
from enc2dec.engine.runner.sampling_ops import race, stream_key
from enc2dec.kernels import reference as ref
from enc2dec.kernels import sampling

HAS_TRITON = importlib.util.find_spec("triton") is not None   # find, not import: TRITON_INTERPRET is read then
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M32 = (1 << 32) - 1
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {4: 18.467, 5: 20.515, 7: 24.322, 9: 27.877}


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Run ``race`` through the Triton kernel (on CPU: interpreted, which ``race`` itself
    never does), or through the torch reference it falls back to."""
    if request.param == "kernel":
        if not HAS_TRITON:
            pytest.skip("triton is not installed")
        monkeypatch.setattr(sampling_ops, "gumbel_race_cpu", sampling.gumbel_race)
    else:
        monkeypatch.setattr(sampling, "can_use_triton", lambda *tensors: False)
    return request.param


def keys_of(rows: int, seed: int) -> torch.Tensor:
    """[rows, 3] keys as the sampler makes them, with the 32-bit extremes among them."""
    keys = torch.tensor([[*stream_key(seed, r), 5 * r] for r in range(rows)])
    keys[0] = torch.tensor([0, 0, 0])
    if rows > 1:
        keys[1] = torch.tensor([M32, M32, M32])             # pos + constant wraps mod 2**32
    return keys.to(DEVICE)


def race_case(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits with dropped (-inf) tokens, a row that keeps one token, and flat rows, whose
    winner is the noise's own argmax (so every hash bit counts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=g) * 2                      # [R, V]
    scores[torch.rand(rows, vocab, generator=g) < 0.4] = float("-inf")
    scores[0] = 0.0
    scores[rows - 1] = float("-inf")
    scores[rows - 1, vocab - 1] = 1.0                                       # the last token, past every full block
    if rows > 3:
        scores[2] = -3.0
    return scores.to(DEVICE)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("rows,vocab,block", [(5, 300, 128), (4, 50, 64), (3, 256, 64)],
                         ids=["vocab 300 over blocks of 128", "vocab below one block", "whole blocks"])
def test_kernel_tokens_equal_the_reference(rows, vocab, block):
    scores, keys = race_case(rows, vocab, seed=vocab), keys_of(rows, seed=vocab)
    want = ref.gumbel_race_ref(scores, keys)
    assert torch.equal(sampling.gumbel_race(scores, keys, block=block), want)
    # The sampler's layout: keys as a column slice of its staged [R, 4] ints, seeded and
    # fresh rows in two tensors, scores as a strided view.
    staged = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=DEVICE), keys], dim=1)   # [R, 4]
    wide = torch.cat([scores, torch.zeros_like(scores)], dim=1)[:, :vocab]                        # stride 2V
    got = sampling.gumbel_race(wide, staged[:2, 1:], staged[2:, 1:], block=block)
    assert torch.equal(got, want)
    assert want[rows - 1] == vocab - 1 and bool(torch.isfinite(scores.gather(1, want[:, None])).all())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_picks_token_zero_in_a_row_with_nothing_left():
    scores = torch.full((1, 70), float("-inf"), device=DEVICE)
    keys = keys_of(1, seed=3)
    assert sampling.gumbel_race(scores, keys, block=32).tolist() == ref.gumbel_race_ref(scores, keys).tolist() == [0]


def test_seeded_rows_do_not_depend_on_the_batch(path):
    rows, vocab = 5, 200
    scores, keys = race_case(rows, vocab, seed=1), keys_of(rows, seed=9)
    batch = race(scores, keys[:3], 3)                                      # 3 seeded rows, then 2 unseeded
    for r in range(3):
        assert race(scores[r:r + 1], keys[r:r + 1], 1).item() == batch[r].item()
    reordered = race(scores[[2, 0, 1]], keys[[2, 0, 1]], 3)
    assert reordered.tolist() == batch[[2, 0, 1]].tolist()
    assert bool(torch.isfinite(scores.gather(1, batch[:, None])).all())    # unseeded rows too: never a dropped token


def test_a_seeded_row_changes_with_its_key_and_position(path):
    vocab, steps = 40, 12
    scores = torch.zeros(steps, vocab, device=DEVICE)
    base = torch.tensor([*stream_key(1234, 0), 0], device=DEVICE).expand(steps, -1).clone()
    base[:, 2] = torch.arange(steps, device=DEVICE)                        # one stream over 12 positions
    over_positions = race(scores, base, steps).tolist()
    other = base.clone()
    other[:, :2] = torch.tensor(stream_key(1234, 1), device=DEVICE)        # the request's second sample
    assert len(set(over_positions)) > 6
    assert race(scores, other, steps).tolist() != over_positions
    assert race(scores, base, steps).tolist() == over_positions           # no hidden state


def _chi2(ids: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    counts = np.bincount(ids.cpu().numpy(), minlength=logits.numel())
    want = logits.double().softmax(dim=-1).cpu().numpy() * ids.numel()
    assert counts[want == 0].sum() == 0, f"dropped tokens drawn: {counts}"
    kept = want > 0
    return float(((counts[kept] - want[kept]) ** 2 / want[kept]).sum()), int(kept.sum()) - 1


@pytest.mark.parametrize("streams", ["seed per row", "one seed over positions", "unseeded"])
def test_reference_race_follows_the_softmax(streams):
    # 20,000 draws are too many for the interpreter; the kernel's tokens equal these (above),
    # and test_kernels_gpu.py repeats this check with the compiled kernel.
    draws = 20_000
    logits = torch.tensor([1.4, 1.1, 0.9, float("-inf"), 0.3, -0.2, -0.8, float("-inf"), -1.5, 0.6])
    if streams == "seed per row":
        keys = torch.tensor([[*stream_key(s, 0), 3] for s in range(draws)])
    elif streams == "one seed over positions":
        keys = torch.tensor([[*stream_key(42, 0), p] for p in range(draws)])
    else:
        torch.manual_seed(0)
        keys = torch.empty(0, 3, dtype=torch.long)
    ids = race(logits.expand(draws, -1), keys, keys.shape[0])
    chi2, dof = _chi2(ids, logits)
    assert chi2 < CHI2_CRITICAL[dof], f"chi2={chi2:.1f} with {dof} degrees of freedom"


def test_seeded_exponential_is_minus_log_of_the_race_noise():
    # The sampler's exponential noise and the race's Gumbel noise come from one hash.
    keys = keys_of(3, seed=2).cpu()
    u = ref.race_uniform_ref(keys, 100)
    assert torch.equal(sampling_ops.seeded_exponential(keys, 100), -u.log())
    assert bool(((u > 0) & (u < 1)).all())


def filter_case(rows: int, vocab: int, seed: int):
    """``race_case``'s rows with scores rounded to quarters (ties, as bf16 logits have them),
    and per-row filters: top-p alone, top-k with ties at its floor, min-p, all three, none."""
    scores = (race_case(rows, vocab, seed) * 4).round() / 4
    top_k = torch.tensor([0, 3, 0, 40, 1, 0, 7][:rows], device=DEVICE)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.8, 0.5, 0.97, 0.3][:rows], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.2, 0.05, 0.0, 0.0, 0.5][:rows], device=DEVICE)
    return scores, top_k, top_p, min_p


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("rows,vocab,block", [(7, 300, 64), (5, 40, 64)], ids=["over blocks", "below one block"])
def test_filtered_kernel_tokens_equal_the_reference(rows, vocab, block):
    for seed in range(3):
        scores, top_k, top_p, min_p = filter_case(rows, vocab, seed)
        floor = ref.top_k_floor_ref(scores, top_k, 40)
        keys = keys_of(rows, seed=seed)
        want = ref.filtered_race_ref(scores, floor, top_p, min_p, keys)
        got = sampling.filtered_race(scores, floor, top_p, min_p, keys[:2], keys[2:], block=block)
        assert got.tolist() == want.tolist()
        kept = ref.filter_scores_ref(scores, floor, top_p, min_p)
        assert bool(torch.isfinite(kept.gather(1, want[:, None])).all()), "a dropped token won"


def test_filters_keep_the_tokens_transformers_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    cases = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=20, top_p=0.9, min_p=0.02)]
    for case in cases:
        scores = torch.randn(8, 100, generator=g) * 2
        warpers = []
        if "top_k" in case:
            warpers.append(TopKLogitsWarper(case["top_k"]))
        if "top_p" in case:
            warpers.append(TopPLogitsWarper(case["top_p"]))
        if "min_p" in case:
            warpers.append(MinPLogitsWarper(case["min_p"]))
        want = scores.clone()
        for w in warpers:
            want = w(None, want)
        k = torch.full((8,), case.get("top_k", 0))
        floor = ref.top_k_floor_ref(scores, k, case.get("top_k", 0))
        got = ref.filter_scores_ref(scores, floor, torch.full((8,), case.get("top_p", 1.0)),
                                    torch.full((8,), case.get("min_p", 0.0)))
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), case


def test_filtered_race_follows_the_filtered_softmax(path):
    # top-k 6 then top-p 0.9 then min-p 0.1 over a 10-token row; the survivors' shares
    # must follow their renormalised softmax (chi-square), the rest never be drawn.
    draws = 20_000 if path == "reference" else 300       # the interpreter: a few hundred rows
    logits = torch.tensor([1.4, 1.1, 0.9, float("-inf"), 0.3, -0.2, -0.8, float("-inf"), -1.5, 0.6])
    scores = logits.expand(draws, -1).to(DEVICE)
    filters = (torch.full((draws,), 6, device=DEVICE), torch.full((draws,), 0.9, device=DEVICE),
               torch.full((draws,), 0.1, device=DEVICE), 6)
    keys = torch.tensor([[*stream_key(s, 0), 3] for s in range(draws)], device=DEVICE)
    if path == "kernel":
        ids = sampling.filtered_race(scores, ref.top_k_floor_ref(scores, filters[0], 6), *filters[1:3], keys)
    else:
        ids = race(scores, keys, draws, filters)
    kept = ref.filter_scores_ref(logits[None], ref.top_k_floor_ref(logits[None], torch.tensor([6]), 6),
                                 torch.tensor([0.9]), torch.tensor([0.1]))[0]
    assert int(torch.isfinite(kept).sum()) == 5           # the case really filters
    if path == "kernel":
        assert ids.tolist() == race(scores.cpu(), keys.cpu(), draws, tuple(
            t.cpu() if torch.is_tensor(t) else t for t in filters)).tolist()
        return
    chi2, dof = _chi2(ids, kept)
    assert chi2 < CHI2_CRITICAL[dof], f"chi2={chi2:.1f} with {dof} degrees of freedom"


def _rounds_needed(scores, floor, top_p, min_p, keys) -> list[int]:
    """Per row, the rejection rounds the kernel's search takes to its winner (a torch replay:
    race the top-k set, then race again over the tokens before a winner the filters drop)."""
    kept = ref.filter_scores_ref(scores, floor, top_p, min_p)
    value = scores.float() - (-ref.race_uniform_ref(keys, scores.shape[1]).log()).log()
    rounds = []
    for r in range(scores.shape[0]):
        s, v = scores[r].float(), value[r]
        in_set = s >= floor[r]
        n = 0
        while True:
            w = int(torch.where(in_set, v, torch.full_like(v, float("-inf"))).argmax())
            if bool(torch.isfinite(kept[r, w])) or not bool(torch.isfinite(s).any()):
                break
            ids = torch.arange(s.numel(), device=s.device)
            in_set = in_set & ((s > s[w]) | ((s == s[w]) & (ids < w)))
            n += 1
        rounds.append(n)
    return rounds


def split_case(rows: int, vocab: int, seed: int):
    """``filter_case`` plus rows that stress the split race: coarse ties across chunk edges
    under a tight top-p (several rejection rounds), top-k wider than a chunk, the only
    survivor in the last chunk, and a row with nothing left."""
    scores, top_k, top_p, min_p = filter_case(rows, vocab, seed)
    g = torch.Generator().manual_seed(100 + seed)
    scores[3] = torch.randint(0, 2, (vocab,), generator=g).float().to(DEVICE)   # 2 levels: ties everywhere
    top_p[3], top_k[3], min_p[3] = 0.02, 0, 0.0
    scores[4] = float("-inf")
    scores[4, vocab - 5:] = 2.0                                               # only the last chunk, all tied
    top_p[4], top_k[4] = 0.5, 2
    scores[5] = float("-inf")
    top_k[6] = vocab // 2                                                     # top-k over several chunks
    top_p[6], min_p[6] = 0.1, 0.0
    return scores, top_k, top_p, min_p


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("splits", [2, 3, 7], ids=["2 chunks", "3 uneven chunks", "7 chunks, 2 empty"])
def test_split_filtered_race_tokens_equal_the_reference(splits, monkeypatch):
    # vocab 300 in blocks of 32: 10 blocks; 7 chunks of 2 blocks leave the last two empty
    rows, vocab, block = 7, 300, 32
    several = False
    for seed in range(2):
        scores, top_k, top_p, min_p = split_case(rows, vocab, seed)
        floor = ref.top_k_floor_ref(scores, top_k, vocab // 2)
        keys = keys_of(rows, seed=seed)
        want = ref.filtered_race_ref(scores, floor, top_p, min_p, keys)
        per_row = sampling.filtered_race(scores, floor, top_p, min_p, keys[:2], keys[2:], block=block, splits=1)
        got = sampling.filtered_race(scores, floor, top_p, min_p, keys[:2], keys[2:], block=block, splits=splits)
        assert got.tolist() == want.tolist() == per_row.tolist()
        assert got[4] >= vocab - 5 and got[5] == 0
        several |= max(_rounds_needed(scores, floor, top_p, min_p, keys)) > sampling.SPLIT_ROUNDS
    assert several, "no row outlasted the split rounds: the per-row finish went untested"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("split_rounds", [0, 1, 4])
def test_split_filtered_race_with_any_number_of_split_rounds(split_rounds, monkeypatch):
    # The rounds run split and those left to the per-row finish must hand over exactly.
    monkeypatch.setattr(sampling, "SPLIT_ROUNDS", split_rounds)
    rows, vocab, block = 7, 200, 16
    scores, top_k, top_p, min_p = split_case(rows, vocab, seed=5)
    floor = ref.top_k_floor_ref(scores, top_k, vocab // 2)
    keys = keys_of(rows, seed=5)
    rounds = _rounds_needed(scores, floor, top_p, min_p, keys)
    assert max(rounds) >= 3 and min(rounds) == 0, rounds
    want = ref.filtered_race_ref(scores, floor, top_p, min_p, keys)
    got = sampling.filtered_race(scores, floor, top_p, min_p, keys, block=block, splits=4)
    assert got.tolist() == want.tolist()


def test_split_choice_fills_the_gpu_but_keeps_chunks_long():
    # planning only (no kernel): few rows get several programs each, many rows one
    assert sampling.race_splits(64, 32128) > 1
    assert sampling.race_splits(4096, 32128) == 1
    for rows in (1, 8, 64, 128):
        splits = sampling.race_splits(rows, 32128)
        assert -(-32128 // sampling.BLOCK) // splits >= sampling.MIN_SPLIT_BLOCKS
    assert sampling.race_splits(1, 300, block=64) == 1          # 5 blocks: too short to split
    # a long row among many is still cut to chunks of about SPLIT_CHUNK_BLOCKS (Whisper's vocab at C=256)
    assert -(-51866 // sampling.BLOCK) // sampling.race_splits(256, 51866) < 2 * sampling.SPLIT_CHUNK_BLOCKS


def test_split_race_scratch_is_shared_by_one_threads_steps_only():
    # One engine thread's launches run in order, so its steps reuse the buffers; a second
    # engine's thread may interleave its launches with these, so it must get its own.
    import threading

    from enc2dec.kernels.sampling import _split_scratch

    mine = _split_scratch(4, 8, 2, torch.device("cpu"))
    assert all(a is b for a, b in zip(mine, _split_scratch(4, 8, 2, torch.device("cpu"))))
    theirs = []
    t = threading.Thread(target=lambda: theirs.extend(_split_scratch(4, 8, 2, torch.device("cpu"))))
    t.start()
    t.join()
    assert len(theirs) == 5 and not any(a.data_ptr() == b.data_ptr() for a, b in zip(mine, theirs))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_sampled_batch_of_any_size_launches_the_kernel_variants_already_compiled():
    # Triton compiles a kernel once per specialisation, and a pointer argument's is its 16-byte
    # alignment: a batch size that shifted a scratch slice off that boundary compiled new round
    # kernels at its first sampled step, a 0.3-0.4 s stall of every running request. Every
    # pointer the races pass is aligned, whatever the rows and seeded rows.
    from launch_recorder import recorded

    vocab, block, splits = 300, 32, 4
    for rows, num_seeded in ((1, 0), (3, 1), (7, 3), (63, 0), (63, 5), (64, 17), (100, 99)):
        scores = torch.randn(rows, vocab)
        top_p, min_p = torch.full((rows,), 0.9), torch.zeros(rows)
        floor = torch.full((rows,), -float("inf"))
        keys = keys_of(rows, seed=rows)
        seeded, fresh = keys[:num_seeded], keys[num_seeded:]
        with recorded(sampling) as launches:
            sampling.filtered_race(scores, floor, top_p, min_p, seeded, fresh, block=block, splits=splits)
            sampling.filtered_race(scores, floor, top_p, min_p, seeded, fresh, block=block, splits=1)
            sampling.gumbel_race(scores, seeded, fresh, block=block)
        names = {name for name, *_ in launches}
        assert {"_split_floor_kernel", "_split_round_kernel", "_split_finish_kernel", "_filtered_race_kernel",
                "_gumbel_race_kernel"} <= names, names
        for name, _, args, _ in launches:
            offsets = [a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor)]
            assert not any(offsets), (rows, num_seeded, name, offsets)


def test_cpu_race_tokens_equal_the_reference():
    """The CPU race (numpy's uint32 hash, the kernel's search instead of a sort) draws the
    reference's tokens: flat, tied and coarse rows, top-k floors with ties, tight top-p that
    takes several rejection rounds, min-p, rows with one or no token left, seeded and fresh keys."""
    rows, vocab = 7, 300
    rounds = 0
    for seed, case in [(s, c) for s in range(4) for c in (filter_case, split_case)]:
        scores, top_k, top_p, min_p = case(rows, vocab, seed)
        scores, top_k, top_p, min_p = (t.cpu() for t in (scores, top_k, top_p, min_p))
        keys = keys_of(rows, seed=seed).cpu()
        assert torch.equal(sampling_ops.race_uniform_cpu(keys, vocab), ref.race_uniform_ref(keys, vocab))
        assert sampling_ops.gumbel_race_cpu(scores, keys[:3], keys[3:]).tolist() == \
            ref.gumbel_race_ref(scores, keys).tolist()
        floor = ref.top_k_floor_ref(scores, top_k, vocab // 2)
        got = sampling_ops.filtered_race_cpu(scores, floor, top_p, min_p, keys[:3], keys[3:])
        assert got.tolist() == ref.filtered_race_ref(scores, floor, top_p, min_p, keys).tolist()
        assert case is filter_case or (got[5] == 0 and got[4] >= vocab - 5)
        rounds = max(rounds, *_rounds_needed(scores, floor, top_p, min_p, keys))
    assert rounds >= 3                                                        # the search's later rounds ran


def test_cpu_race_keeps_the_filters_exact_boundaries():
    """Rows where min-p alone decides, and where top-p's mass before a token equals the cut
    exactly (four tied tokens, top-p 0.5: the first two stay, the third does not), drawn with
    64 keys each: the CPU race keeps exactly the reference's tokens."""
    draws, vocab = 64, 50
    min_p_row = torch.full((vocab,), -4.0)
    min_p_row[:3] = torch.tensor([2.0, 1.9, 1.0])            # min-p 0.5 keeps scores >= 2 - ln 2: tokens 0, 1
    tied_row = torch.full((vocab,), float("-inf"))
    tied_row[10:14] = 0.0                                    # mass 1 each: before token 12 is exactly 2 = 0.5 x 4
    scores = torch.cat([min_p_row.expand(draws, -1), tied_row.expand(draws, -1)])
    top_p = torch.cat([torch.ones(draws), torch.full((draws,), 0.5)])
    min_p = torch.cat([torch.full((draws,), 0.5), torch.zeros(draws)])
    floor = torch.full((2 * draws,), float("-inf"))
    keys = torch.tensor([[*stream_key(s, 0), 7] for s in range(2 * draws)])
    got = sampling_ops.filtered_race_cpu(scores, floor, top_p, min_p, keys)
    assert got.tolist() == ref.filtered_race_ref(scores, floor, top_p, min_p, keys).tolist()
    assert set(got[:draws].tolist()) == {0, 1} and set(got[draws:].tolist()) == {10, 11}
    # unfiltered, the same keys draw outside both kept sets
    assert set(ref.gumbel_race_ref(scores, keys).tolist()) - {0, 1, 10, 11}
