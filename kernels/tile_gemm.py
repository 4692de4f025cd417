"""``y = act(x @ W.T + b)`` for a decode step's batch of rows (2-256; the engine sends it up to
64): a tensor-core tile GEMM that launches programmatically.

A decode step at C=64 runs ~150 products of 64 rows; each costs cuBLAS about 4 us on an H100 or
an H200 alike, 4-8x its weight read (docs/benchmarks.md, session 33's ``gemm_probe.py``): the
time is the launch and the K loop's memory latency, not the bytes or the tile count. cuBLAS
cannot overlap either with the kernel before it. This kernel can (``set_programmatic_launch``):
launched while the previous kernel of the step still runs, each program first asks L2 for its
weight rows (no earlier kernel of the step writes weights), then waits for the previous
kernel's memory, so its K loop reads weights from L2 and the launch gap is gone. Without
programmatic launch it is a plain tile GEMM (no faster than cuBLAS, session 33), so the engine
takes it only with programmatic launch on (``tuning.tile_gemm``).

Programs are ``BLOCK_N`` output features by ``BLOCK_M`` rows (narrow, so even a 1024-wide
product keeps many SMs reading); the activation epilogue (``act``, ``gated``) is the skinny
GEMV's, so a gated MLP's gate|up product and ``act(gate) * up`` stay one kernel here too, and so
is its input ``Prologue``: a pre-norm (+ residual add) computed as the rows load.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import skinny_linear_ref
from .skinny_gemm import ACTIVATIONS, Prologue, _epilogue, _prefetch_rows, activation_ref, input_args

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

MIN_ROWS = 2      # one row is the skinny GEMV's
MAX_ROWS = 256    # the most rows it takes; ``tile_pays`` says where it is the faster product


@lazy_jit
def _tile_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, nb_ptr, res_out_ptr, part_ptr, count_ptr,
                      M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, NORM_BIAS: tl.constexpr,
                      ACT: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # out[M, N] = act(x[M, K] @ w[N, K].T + b); GATED: weight rows [N, 2N) are the "up" half
    # and out[:, n] = act(x . w[n]) * (x . w[N + n]). EVEN_K: K % BLOCK_K == 0, no K mask.
    # IEEE: float32 operands multiplied as float32 (tl.dot's default would round them to tf32).
    # Prologue, NORM: 0 none, 1 RMSNorm, 2 LayerNorm of x (+ residual with HAS_RES, the sum
    # rounded to the activation dtype; the programs of the first feature tile write it out).
    # SPLIT_K > 1 (no LayerNorm prologue): program (n, m, s) sums K's piece [s * K_SPLIT, (s + 1) * K_SPLIT)
    # into its float32 partial part[s, (up,) M, N]; the last of a tile's SPLIT_K programs to count
    # itself in count[tile] adds the partials in the order of s (the same sum whichever program
    # comes last), applies the epilogue and sets the count back to 0 for the next launch.
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    up_ptr = w_ptr + N.to(tl.int64) * stride_wn
    k_lo = pid_k * K_SPLIT
    k_hi = K
    if SPLIT_K > 1:
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
    if PDL:
        # The programs of one column of tiles read the same weight rows: the first asks for them.
        if pid_m == 0:
            _prefetch_rows(w_ptr + k_lo, offs_n, mask_n, stride_wn, k_hi - k_lo, BLOCK_K)
            if GATED:
                _prefetch_rows(up_ptr + k_lo, offs_n, mask_n, stride_wn, k_hi - k_lo, BLOCK_K)
        wait_for_previous_kernel()      # before the first activation load
    act_dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm
    w_rows = offs_n[None, :].to(tl.int64) * stride_wn
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM == 2:
        # A LayerNorm's row statistics in one pass over K before the K loop, each row's pieces
        # read from L2: every piece's mean and centred sum of squares, merged into the row's as
        # they come (Chan et al.'s parallel update: centred throughout, as the norm kernel's two
        # passes are, without reading the rows a second time). An RMSNorm needs no pass of its
        # own: its rstd is one factor a row, applied to the product of the unscaled rows
        # (x * weight) after the K loop, which sums the squares as it goes (over a split's piece:
        # the last program adds the pieces' sums).
        m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K, HAS_RES, EVEN_K)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            valid = ((offs_k < K) | EVEN_K)[None, :]
            n_piece = tl.minimum(K - k0, BLOCK_K).to(tl.float32)
            mean_piece = tl.sum(h, axis=1) / n_piece
            c = tl.where(valid, h - mean_piece[:, None], 0.0)
            seen = k0 * 1.0                 # positions merged so far
            delta = mean_piece - mean
            mean += delta * (n_piece / (seen + n_piece))
            m2 += tl.sum(c * c, axis=1) + delta * delta * (seen * n_piece / (seen + n_piece))
        rstd = tl.rsqrt(m2 / K + eps)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) | EVEN_K
        mk = mask_m[:, None] & mask_k[None, :]
        if NORM != 0:
            h = _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K, HAS_RES, EVEN_K)
            if HAS_RES:
                tl.store(res_out_ptr + offs_m[:, None].to(tl.int64) * stride_rom + offs_k[None, :],
                         h.to(act_dtype), mask=mk & (pid_n == 0))
            g = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if NORM == 1:
                ss += tl.sum(h * h, axis=1)
                a = h * g
            else:
                a = (h - mean[:, None]) * rstd[:, None] * g
            if NORM_BIAS:
                a = a + tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            a = a.to(act_dtype)
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0)                               # [BM, BK]
        mask_w = mask_n[None, :] & mask_k[:, None]
        b = tl.load(w_ptr + w_rows + offs_k[:, None], mask=mask_w, other=0.0)                       # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision="ieee" if IEEE else None)
        if GATED:
            b_up = tl.load(up_ptr + w_rows + offs_k[:, None], mask=mask_w, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee" if IEEE else None)
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tile_part = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        plane = M.to(tl.int64) * N * (2 if GATED else 1)            # one split's partials
        # an RMSNorm's sums of squares, one row of M a (split, feature tile) after the planes
        ss_ptr = part_ptr + SPLIT_K * plane + pid_n * M + offs_m
        tl.store(part_ptr + pid_k * plane + tile_part, acc, mask=mask_out, cache_modifier=".cg")
        if GATED:
            tl.store(part_ptr + pid_k * plane + M * N + tile_part, acc_up, mask=mask_out, cache_modifier=".cg")
        if NORM == 1:
            tl.store(ss_ptr + pid_k * tl.num_programs(0) * M, ss, mask=mask_m, cache_modifier=".cg")
        tl.debug_barrier()              # every thread's partial stored before the count (release) says so
        count = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * plane + tile_part, mask=mask_out, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptr + s * plane + M * N + tile_part, mask=mask_out, other=0.0,
                                      cache_modifier=".cg")
                if NORM == 1:
                    ss += tl.load(ss_ptr + s * tl.num_programs(0) * M, mask=mask_m, other=0.0, cache_modifier=".cg")
            _finish_tile(acc, acc_up, ss, K, eps, b_ptr, out_ptr, offs_m, offs_n, mask_n, mask_out, stride_om, N,
                         act_dtype, NORM, HAS_BIAS, ACT, GATED)
            tl.atomic_xchg(count, 0, sem="relaxed")
    else:
        _finish_tile(acc, acc_up, ss, K, eps, b_ptr, out_ptr, offs_m, offs_n, mask_n, mask_out, stride_om, N,
                     act_dtype, NORM, HAS_BIAS, ACT, GATED)


@lazy_jit.helper
def _finish_tile(acc, acc_up, ss, K, eps, b_ptr, out_ptr, offs_m, offs_n, mask_n, mask_out, stride_om, N, act_dtype,
                 NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    # a whole K's accumulators: an RMSNorm prologue's rstd (from the rows' sums of squares), the
    # bias and activation epilogue, the store
    if NORM == 1:
        rstd = tl.rsqrt(ss / K + eps)
        acc, acc_up = acc * rstd[:, None], acc_up * rstd[:, None]
    acc = _epilogue(acc, acc_up, b_ptr, offs_n, mask_n, N, act_dtype, HAS_BIAS, ACT, GATED)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(act_dtype), mask=mask_out)


@lazy_jit.helper
def _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr,
                EVEN_K: tl.constexpr):
    # [BM, BK] of x (+ residual, rounded to the activation dtype as the model's sum is) in fp32
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mk = mask_m[:, None] & ((offs_k < K) | EVEN_K)[None, :]
    h = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
        h = (h + r).to(act_dtype).to(tl.float32)
    return h


def launch_config(rows: int, n: int, k: int, itemsize: int = 2,
                  split_ok: bool = True) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for an ``[rows, k] x [n, k]^T``
    product of ``itemsize``-byte elements: the measured file's (``set_configs_file``) where it
    has the shape (its best unsplit one unless ``split_ok``), else the rule below (no split).

    From session 37's sweep on an H100 (``gemm_probe.py --triton --pdl``, 64 rows, flan-t5-large's
    and whisper-large-v3's decode products, docs/benchmarks.md): four stages; 32 features by 128 of
    K for square products up to 1280 (1024 x 1024: 3.15 us against cuBLAS's 4.13), 32 by 256 for
    q|k|v (3072 x 1024: 4.32 against 5.28), 16 by 256 for a long K (1024 x 2816: 5.96 against
    7.08), 64 by 128 from 4,096 features (whisper's head: 57.2 against 80.4). Rows are tiled by up
    to 64 (``tl.dot`` needs 16). Float32 takes half the K step and three stages, within shared
    memory; a K that no step divides (small test models) takes 16-64 with its tail masked."""
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    measured = _measured(rows, n, k)
    if measured is not None and itemsize == 2:
        config = measured["config" if split_ok else "unsplit"]
        return (min(config[0], block_m),) + config[1:]
    if n >= 4096:
        block_n, block_k = 64, 128
    elif k > 2048:
        block_n, block_k = 16, 256
    elif n > 2048:
        block_n, block_k = 32, 256
    else:
        block_n, block_k = 32, 128
    stages = 4
    if itemsize > 2:
        block_k, stages = block_k // 2, 3
    if k % block_k:
        block_k = 64 if k % 64 == 0 else min(64, max(16, 1 << (k - 1).bit_length()))
    return block_m, block_n, block_k, 4, stages, 1


def _rows_bucket(rows: int) -> int:
    return 64 if rows <= 64 else 128 if rows <= 128 else 256


# The measured configurations file in effect (``tuning.tile_gemm_configs``; process-wide, as the
# tile GEMM's switch is).
_CONFIGS_FILE = {"path": ""}


def set_configs_file(path: str) -> None:
    """Take the tile configurations measured on this kind of GPU from the JSON file at ``path``
    ("" for none; ``bench/scripts/gemm_probe.py --triton --save-configs`` writes it, as vLLM
    ships tuned Triton MoE configurations per GPU): ``{"rows,n,k": {"config": [BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages, SPLIT_K], "unsplit": [the best with SPLIT_K 1], "pays": bool}}`` with
    rows 64, 128 or 256 (the largest row count it holds); "pays": whether it beat cuBLAS there;
    without "unsplit", "config" unsplit. Read and checked now, so a missing or malformed file
    fails the engine's start, not its first product."""
    _read_configs(path)
    _CONFIGS_FILE["path"] = path


# Configurations measured on a kind of GPU and shipped with the package, one file a device name
# (vLLM ships its tuned Triton MoE configurations the same way): ``tile_gemm_<name>.json``, the
# name as ``torch.cuda.get_device_name`` gives it with every run of other characters as "_".
CONFIGS_DIR = Path(__file__).parent / "configs"


def configs_file_for(setting: str, device_name: str) -> str:
    """The configurations file ``tuning.tile_gemm_configs`` names on a GPU called ``device_name``:
    a path as given; "" the file shipped for that GPU (``CONFIGS_DIR``) or, where none is, no
    file (``launch_config``'s rule); "none" no file even where one is shipped."""
    if setting == "none":
        return ""
    if setting:
        return setting
    shipped = CONFIGS_DIR / f"tile_gemm_{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}.json"
    return str(shipped) if device_name and shipped.is_file() else ""


def _measured(rows: int, n: int, k: int) -> dict | None:
    """The configurations file's entry for this product (its rows' bucket), or None."""
    return _read_configs(_CONFIGS_FILE["path"]).get((_rows_bucket(rows), n, k))


@functools.cache
def _read_configs(path: str) -> dict[tuple[int, int, int], dict]:
    if not path:
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
        configs = {}
        for key, value in raw.items():
            shape = tuple(int(v) for v in key.split(","))
            config = tuple(int(v) for v in value["config"])
            unsplit = tuple(int(v) for v in value.get("unsplit", config[:5] + (1,)))
            if len(shape) != 3 or len(config) != 6 or len(unsplit) != 6 or unsplit[5] != 1 or \
                    not isinstance(value["pays"], bool):
                raise ValueError(f"entry {key!r}: want \"rows,n,k\" with a 6-element config, a 6-element "
                                 f"unsplit one with SPLIT_K 1 and a true/false pays, got {value!r}")
            configs[shape] = {"config": config, "unsplit": unsplit, "pays": value["pays"]}
        return configs
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"tuning.tile_gemm_configs: cannot read tile configurations from {path!r}: {e}") from e


def tile_pays(rows: int, n: int, k: int, fused_act: bool) -> bool:
    """Whether the tile GEMM (launched programmatically) beats cuBLAS on this product, by session
    37's sweep on an H100: at up to 64 rows, on every product of at most ~5M weights and on the LM
    heads, not on the wide plain ones (whisper's 5120 x 1280 fc1: 8.0 us against 7.3; 1280 x 5120
    fc2: 10.3 against 9.6) unless the MLP's activation rides in it (a kernel saved); at 128 rows
    cuBLAS won every shape but the square ones (flan-t5-large's products 0.775 against 0.770 ms)."""
    measured = _measured(rows, n, k)
    if measured is not None:
        return measured["pays"] or (fused_act and rows <= 64)
    return rows <= 64 and (fused_act or n * k <= 5 << 20 or n >= 32768)


# Split-K counters: one int32 a tile, zero between launches (the tile's last program sets it back).
# A product's counters are its own (keyed by its weight and tiling), so two products never share
# one, even on two streams; the pool is made outside any CUDA graph capture (a graph would replay
# its zeroing), and a product first seen under capture with no pool yet runs unsplit.
_COUNTS: dict = {}
_COUNT_POOL = 1 << 16


def _split_counts(device: torch.device, key: tuple, tiles: int) -> torch.Tensor | None:
    entry = _COUNTS.get(device)
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        entry = _COUNTS[device] = {"pool": torch.zeros(_COUNT_POOL, dtype=torch.int32, device=device), "at": {},
                                   "used": 0}
    at = entry["at"].get(key)
    if at is None:
        if entry["used"] + tiles > _COUNT_POOL:
            return None
        at = entry["at"][key] = entry["used"]
        entry["used"] += tiles
    return entry["pool"][at:at + tiles]


def tile_linear_supported(rows: int, weight: torch.Tensor) -> bool:
    """Whether ``tile_linear`` runs its kernel for this many rows of this weight (else the reference)."""
    return MIN_ROWS <= rows <= MAX_ROWS and weight.shape[-1] >= 16 and weight.stride(-1) == 1 and \
        weight.dtype in (torch.bfloat16, torch.float16, torch.float32)


def tile_linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                act: str | None = None, gated: bool = False,
                config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` with ``MIN_ROWS``-``MAX_ROWS`` rows of a
    ``weight [N, K]`` (K >= 16; float32 multiplied as float32); ``x`` may be a ``Prologue`` (its
    norm computed as the rows load; the first feature tile's programs write its new residual),
    ``act`` and ``gated`` as ``skinny_linear``'s. Other inputs (or no Triton) take the torch
    references. ``config`` overrides ``launch_config`` (``bench/scripts/gemm_probe.py``; its sixth
    element, SPLIT_K, defaults to 1)."""
    pro = x if isinstance(x, Prologue) else None
    src = pro.x if pro is not None else x
    rows = src.numel() // src.shape[-1] if src.shape[-1] else 0
    if not tile_linear_supported(rows, weight) or src.dtype != weight.dtype or not can_use_triton(src, weight):
        return activation_ref(skinny_linear_ref(pro.materialize() if pro is not None else x, weight, bias), act, gated)
    n, k = weight.shape
    if gated:
        assert n % 2 == 0, f"a gated product needs an even number of weight rows, got {n}"
        n //= 2
    inputs = input_args(x, rows, k, weight)
    out = torch.empty((rows, n), dtype=src.dtype, device=src.device)
    if config is None:
        # a gated product reads both halves: the tiling of its whole weight, each half's tile half as wide
        # a LayerNorm's row statistics span the whole K, which a split would read once per piece
        block_m, block_n, block_k, num_warps, num_stages, split = launch_config(
            rows, weight.shape[0], k, weight.element_size(), split_ok=pro is None or pro.norm == "rms")
        block_n = max(16, block_n // 2) if gated else block_n
        # a normalised input tile is made in registers and staged for the dot: two stages leave room
        num_stages = 2 if pro is not None else num_stages
    else:
        block_m, block_n, block_k, num_warps, num_stages, split = (tuple(config) + (1,))[:6]
    # K in pieces of whole K steps; the split is how many pieces that makes
    k_split = -(-k // (split * block_k)) * block_k if split > 1 else k
    split = -(-k // k_split)
    grid = (-(-n // block_n), -(-rows // block_m), split)
    x2 = inputs.x
    part = counts = weight                           # unread unless split
    if split > 1:
        counts = _split_counts(src.device, (weight.data_ptr(), n, k, grid[0], grid[1]), grid[0] * grid[1])
        if counts is None:
            grid, split, k_split = grid[:2] + (1,), 1, k
            counts = weight
        else:
            planes = split * (2 if gated else 1) * rows * n
            part = torch.empty(planes + (split * grid[0] * rows if inputs.norm == 1 else 0), dtype=torch.float32,
                               device=src.device)
    _tile_gemm_kernel[grid](x2, weight, bias if bias is not None else weight, out, inputs.res, inputs.nw, inputs.nb,
                            inputs.res_out, part, counts, rows, n, k, k_split, x2.stride(0), weight.stride(0),
                            out.stride(0), inputs.res.stride(0), inputs.res_out.stride(0), inputs.eps,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, HAS_BIAS=bias is not None,
                            NORM=inputs.norm, HAS_RES=inputs.has_res, NORM_BIAS=inputs.norm_bias,
                            ACT=ACTIVATIONS[act], GATED=gated, IEEE=weight.dtype == torch.float32,
                            EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages,
                            **launch_options(x2))
    return out.view(*src.shape[:-1], n)
