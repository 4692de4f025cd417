"""Engine configuration: frozen dataclasses validated when built.

The field names are TensorRT-LLM's LLM API names, so the same keys work as ``LLM(...)``
keyword arguments and in the YAML file that ``serve``, ``bench`` and ``eval`` accept.
Unknown keys and invalid values raise ``ValueError`` naming the key and what is valid.
Options TensorRT-LLM has but this engine cannot honour are rejected when set to anything but
their default, never accepted and ignored.

``tuning`` (``TuningConfig``) holds this engine's own performance knobs. Each can also be set
by an environment variable (``TUNING_ENV``), which wins over the config: ``LlmArgs`` resolves
them when it is built, so ``dataclasses.asdict(args)`` (what bench reports record) shows the
values the engine runs with.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

_ATTN_ALIASES = {"torch": "torch", "vanilla": "torch", "triton": "triton", "trtllm": "triton"}
VALID_ATTN_BACKENDS = ("torch", "triton", "TRTLLM", "VANILLA")


def canonical_backend_name(name: str) -> str:
    """``TRTLLM`` -> triton and ``VANILLA`` -> torch, as TensorRT-LLM configs name them."""
    key = str(name).lower()
    if key not in _ATTN_ALIASES:
        raise ValueError(f"attn_backend={name!r} is not supported; valid: auto, {', '.join(VALID_ATTN_BACKENDS)}")
    return _ATTN_ALIASES[key]

VALID_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def _unknown_key_error(owner: str, key: str, valid) -> ValueError:
    hint = difflib.get_close_matches(key, list(valid), n=1)
    extra = f" Did you mean {hint[0]!r}?" if hint else ""
    return ValueError(f"unknown {owner} key {key!r}.{extra} Valid keys: {', '.join(sorted(valid))}")


def _from_dict(cls, data: dict, owner: str):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{owner} must be a mapping of keys to values, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key_error(owner, key, names)
    return cls(**data)


def _check_fraction(owner: str, name: str, value, allow_none=False, lo_open=True):
    if value is None and allow_none:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 < value < 1 if lo_open else 0 <= value <= 1):
        bound = "(0, 1)" if lo_open else "[0, 1]"
        raise ValueError(f"{owner}.{name} must be a number in {bound}, got {value!r}")


def _check_positive_int(owner: str, name: str, value, allow_none=False, allow_zero=False):
    if value is None and allow_none:
        return
    lo = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{owner}.{name} must be an integer >= {lo}, got {value!r}")


def _check_int_list(owner: str, name: str, value):
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value):
        raise ValueError(f"{owner}.{name} must be a non-empty list of positive integers, got {value!r}")


KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class KvCacheConfig:
    """Both KV pools. ``cross_kv_cache_fraction`` is required for encoder-decoder models.

    This engine has one block manager (``engine/core/block_manager.py``); ``use_kv_cache_manager_v2``
    is accepted so TensorRT-LLM configs load, and brings only V2's rule ``max_beam_width=1``."""

    free_gpu_memory_fraction: float = 0.9
    cross_kv_cache_fraction: float | None = None
    tokens_per_block: int = 32
    max_tokens: int | None = None            # cap on self + cross positions, whatever memory allows
    enable_block_reuse: bool = False
    use_kv_cache_manager_v2: bool = False
    # The KV budget when running on the CPU; None: a quarter of the memory available at start-up,
    # at most 4 GiB (core/kv_sizing.auto_cpu_kv_budget). Pages are taken as blocks are written.
    max_cpu_memory_bytes: int | None = None
    # "auto": the model's dtype; "fp8": e4m3 with a float16 scale per position and head
    # (TensorRT-LLM's key), half the bytes of bf16 for both pools.
    dtype: str = "auto"

    def __post_init__(self):
        o = "kv_cache_config"
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{o}.dtype={self.dtype!r} is not valid; valid: {', '.join(KV_CACHE_DTYPES)}")
        _check_fraction(o, "free_gpu_memory_fraction", self.free_gpu_memory_fraction)
        _check_fraction(o, "cross_kv_cache_fraction", self.cross_kv_cache_fraction, allow_none=True)
        _check_positive_int(o, "tokens_per_block", self.tokens_per_block)
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"{o}.tokens_per_block must be a power of two, got {self.tokens_per_block}")
        _check_positive_int(o, "max_tokens", self.max_tokens, allow_none=True)
        _check_positive_int(o, "max_cpu_memory_bytes", self.max_cpu_memory_bytes, allow_none=True)
        if self.enable_block_reuse:
            raise ValueError(f"{o}.enable_block_reuse=True is not supported for encoder-decoder models; "
                             "set it to false")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler is the one in ``engine/core/scheduler.py`` (Python, FCFS admission with a
    step of KV headroom, preemption by recompute when the self pool runs short); these keys
    exist so TensorRT-LLM configs load, and only their defaults are accepted."""

    use_python_scheduler: bool = True
    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"

    def __post_init__(self):
        if self.use_python_scheduler is not True:
            raise ValueError(f"scheduler_config.use_python_scheduler={self.use_python_scheduler!r} is not "
                             "supported: this engine has only the Python scheduler; set it to true")
        if self.capacity_scheduler_policy == "MAX_UTILIZATION":
            raise ValueError("scheduler_config.capacity_scheduler_policy='MAX_UTILIZATION' is not supported: "
                             "the scheduler has one policy (first come, first served, one step of KV headroom, "
                             "preemption of the newest request when the pool runs short); valid: "
                             "GUARANTEED_NO_EVICT")
        if self.capacity_scheduler_policy != "GUARANTEED_NO_EVICT":
            raise ValueError(f"scheduler_config.capacity_scheduler_policy={self.capacity_scheduler_policy!r} "
                             "is not valid; valid: GUARANTEED_NO_EVICT")


# TuningConfig field -> the environment variable that overrides it.
TUNING_ENV = {
    "skinny_gemm": "ENC2DEC_SKINNY_GEMM",
    "fused_gemv": "ENC2DEC_FUSED_GEMV",
    "attn_min_keys_per_split": "ENC2DEC_ATTN_MIN_KEYS_PER_SPLIT",
    "attn_last_split_merges": "ENC2DEC_ATTN_LAST_SPLIT_MERGES",
    "attn_store_in_kernel": "ENC2DEC_ATTN_STORE_IN_KERNEL",
    "programmatic_launch": "ENC2DEC_PROGRAMMATIC_LAUNCH",
    "tile_gemm": "ENC2DEC_TILE_GEMM",
    "tile_gemm_configs": "ENC2DEC_TILE_GEMM_CONFIGS",
    "tile_gemm_norms": "ENC2DEC_TILE_GEMM_NORMS",
    "tp_timeout_s": "ENC2DEC_TP_TIMEOUT_S",
    "encoder_tokens_while_decoding": "ENC2DEC_ENCODER_TOKENS_WHILE_DECODING",
    "encoder_tokens_per_decoding_row": "ENC2DEC_ENCODER_TOKENS_PER_DECODING_ROW",
    "encoder_join_steps": "ENC2DEC_ENCODER_JOIN_STEPS",
    "encoder_beside_decoder": "ENC2DEC_ENCODER_BESIDE_DECODER",
    "encoder_batches_fit_graphs": "ENC2DEC_ENCODER_BATCHES_FIT_GRAPHS",
    "cross_kv_head_major": "ENC2DEC_CROSS_KV_HEAD_MAJOR",
    "cpu_greedy_head": "ENC2DEC_CPU_GREEDY_HEAD",
}


@dataclass(frozen=True)
class TuningConfig:
    """Performance knobs of this engine (no TensorRT-LLM equivalent); the defaults are the
    measured best (docs/benchmarks.md). Results do not depend on them, only speed does."""

    skinny_gemm: bool = True              # one-row decode projections through the skinny GEMV (CUDA, triton)
    fused_gemv: bool = True               # pre-norms, MLP activations and K/V stores ride in that GEMV
    attn_min_keys_per_split: int = 32     # fewest keys a split-K paged-attention program gets
    # The last split-K program of each (token, head) merges the splits, instead of a second
    # kernel after the attention kernel: one launch fewer per attention call with splits (48 a
    # flan-t5-large step; docs/benchmarks.md, session 34).
    attn_last_split_merges: bool = True
    # On a decode step (one token per sequence) the self-attention kernel stores the new K/V
    # itself, instead of a store kernel before it: one launch fewer per layer (docs/benchmarks.md,
    # session 37: flan-t5-large C=64 356 kernels a step instead of 380).
    attn_store_in_kernel: bool = True
    # The Triton kernels launch with programmatic dependent launch (Hopper and later): each may
    # be launched while the kernel before it finishes and waits for its memory on the GPU, which
    # hides a launch's latency between dependent kernels (kernels/__init__.py). Process-wide.
    # With the store above on an H100 (session 37): flan-t5-large C=1 1,074 out tok/s against 968.
    programmatic_launch: bool = True
    # Batched decode products (2-64 rows) through the Triton tile GEMM instead of cuBLAS where it
    # is the faster (``kernels/tile_gemm.tile_pays``), with the MLP's activation as its epilogue.
    # Only with programmatic launch: launched early, each product pulls its weights into L2 while
    # the kernel before it runs, which cuBLAS cannot; without it the kernel is slower than cuBLAS.
    tile_gemm: bool = False
    # A JSON file of the tile GEMM's configurations measured on this kind of GPU (each shape's
    # tiling, split of K, and whether it beat cuBLAS: ``bench/scripts/gemm_probe.py --triton
    # --save-configs``); "" the file shipped for this GPU's name (``kernels/configs/``), where there is
    # one, else ``kernels/tile_gemm.launch_config``'s rule, which never splits K; "none" that rule.
    tile_gemm_configs: str = ""
    # With the tile GEMM on, a batch's pre-norm (+ residual add) computed in the projection after it,
    # as one-row steps do in the GEMV. Off: its normalised input tile leaves room for two pipeline
    # stages only, and flan-t5-large C=64 fell from 31,604 to 19,243 out tok/s with it (H100,
    # docs/benchmarks.md session 40), where the tile GEMM without it gave 34,492.
    tile_gemm_norms: bool = False
    tp_timeout_s: float = 600.0           # longest wait of a tensor-parallel collective or worker start-up
    # Encoder positions admitted in a step that also decodes running sequences. 0 (auto): one
    # clip for Whisper, so admitting requests costs the running ones at most one encoder pass of
    # latency per step (two for an encoder-heavy Whisper encoded beside the decoder, see
    # ``encoder_admission``); no bound for text models, whose encoders are cheap. A value bounds
    # any model (smoother inter-token latency, slower fill after a burst of arrivals). A
    # microbatch that replays an encoder graph counts the graph's positions, padding included.
    encoder_tokens_while_decoding: int = 0
    # The same bound in proportion to the rows the step decodes: n running sequences admit at
    # most n times this many encoder positions (0: none; with both set the smaller applies). A
    # decode step's time grows with its rows and an encode beside it costs the same whatever
    # they are, so one fixed bound suits one concurrency: bart-large-cnn kept its ITL p99 within
    # 3x p50 and gained throughput with 2,048 positions at C=64 and 4,096 at C=128, and lost up to
    # 4% with 2,048 at C=128 (docs/benchmarks.md, sessions 33-34). 40 a row admits what each did
    # (graph-padded microbatches of 384-position inputs: 4 x 512 from 52 rows, 8 x 512 from 103).
    encoder_tokens_per_decoding_row: int = 0
    # On one CUDA GPU, requests admitted while others decode are encoded on a second stream,
    # beside the next decode step, and join the batch one step later, so the running sequences
    # do not wait for a new request's encoder (tensor parallel and the CPU always encode in the
    # step). Measured in docs/benchmarks.md, Run Q.
    encoder_beside_decoder: bool = True
    # Decoding steps such a request waits before it joins (its encoder has that long to run
    # beside them; the main stream waits for it on the GPU only if it has not finished). One
    # suits an encoder that costs about a decoding step; a model whose encoder costs several
    # (whisper-large-v3-turbo: 32 encoder layers, 4 decoder layers) wants more. Counted in
    # schedule() calls, not measured time, so a run's batches do not depend on GPU timing.
    # 0 (auto): 2 for an encoder-heavy Whisper, else 1 (``encoder_admission``).
    encoder_join_steps: int = 0
    # With encoder CUDA graphs (padded batches): admission stops adding requests to a step's
    # encoder microbatch where the next one would leave every captured graph, so the microbatch
    # replays a graph (beside the decoder, one launch) instead of running eagerly on the main
    # stream (hundreds of launches the running sequences wait for). Its first request is always
    # admitted.
    encoder_batches_fit_graphs: bool = True
    # The triton backend's cross K/V pools stored head-major ([heads, blocks, positions,
    # head_dim]): a decode program, one (row, head), then reads a request's keys for its head
    # as one contiguous run instead of 128-byte rows 2.5 KB apart (whisper-large-v3: +2.7% with
    # bf16 KV, +7% with FP8, docs/benchmarks.md, session 28). The torch backend (the CPU) stores
    # its pools head-major anyway (FP8 aside).
    cross_kv_head_major: bool = True
    # Float32 on the CPU: a step of bare argmax rows finds their ids through a bfloat16 copy of
    # the LM head and proves them in float32 (engine/runner/greedy_head.py), instead of reading
    # the float32 head whole.
    cpu_greedy_head: bool = True

    def __post_init__(self):
        o = "tuning"
        for name in ("skinny_gemm", "fused_gemv", "encoder_beside_decoder", "encoder_batches_fit_graphs",
                     "cross_kv_head_major", "cpu_greedy_head", "attn_last_split_merges",
                     "attn_store_in_kernel", "programmatic_launch", "tile_gemm", "tile_gemm_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{o}.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.tile_gemm_configs, str):
            raise ValueError(f"{o}.tile_gemm_configs must be a file path or \"\", got {self.tile_gemm_configs!r}")
        _check_positive_int(o, "attn_min_keys_per_split", self.attn_min_keys_per_split)
        _check_positive_int(o, "encoder_tokens_while_decoding", self.encoder_tokens_while_decoding, allow_zero=True)
        _check_positive_int(o, "encoder_tokens_per_decoding_row", self.encoder_tokens_per_decoding_row,
                            allow_zero=True)
        _check_positive_int(o, "encoder_join_steps", self.encoder_join_steps, allow_zero=True)
        t = self.tp_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"{o}.tp_timeout_s must be a number of seconds > 0, got {t!r}")

    def with_env(self, environ) -> "TuningConfig":
        """This config with every ``TUNING_ENV`` variable set in ``environ`` applied."""
        changes, defaults = {}, TuningConfig()
        for name, var in TUNING_ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            kind = type(getattr(defaults, name))
            try:
                if kind is bool:
                    if raw not in ("0", "1"):
                        raise ValueError
                    changes[name] = raw == "1"
                elif kind is str:
                    changes[name] = raw
                else:
                    changes[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} (tuning.{name}) is not valid; expected "
                                 f"{'0 or 1' if kind is bool else 'a number'}") from None
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decoder (and mixed) step graphs for a grid of padded batch sizes."""

    batch_sizes: tuple[int, ...] | None = None
    max_batch_size: int = 0
    enable_padding: bool = False

    def __post_init__(self):
        _check_int_list("cuda_graph_config", "batch_sizes", self.batch_sizes)
        _check_positive_int("cuda_graph_config", "max_batch_size", self.max_batch_size, allow_zero=True)
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))

    def capture_sizes(self, engine_max_batch_size: int) -> list[int]:
        if self.batch_sizes:
            return [b for b in self.batch_sizes if b <= engine_max_batch_size]
        top = min(self.max_batch_size or engine_max_batch_size, engine_max_batch_size)
        if not self.enable_padding:
            return list(range(1, top + 1)) if top <= 8 else [1, 2, 4] + list(range(8, top + 1, 8))
        sizes, b = [], 1
        while b < top:
            sizes.append(b)
            b = b * 2 if b < 8 else b + 8
        return sizes + [top]


@dataclass(frozen=True)
class EncodeCudaGraphConfig:
    """Encoder graphs per (batch, sequence length) bucket over a padded layout; ``num_tokens``
    caps a bucket's padded tokens (``batch * length``). On by default with padding (a batch
    takes the next larger bucket); ``encoder_cuda_graph_config=None`` turns them off
    (measured in docs/benchmarks.md, run I)."""

    batch_sizes: tuple[int, ...] | None = None
    num_tokens: tuple[int, ...] | None = None
    seq_lens: tuple[int, ...] | None = None
    enable_padding: bool = False

    def __post_init__(self):
        for name in ("batch_sizes", "num_tokens", "seq_lens"):
            value = getattr(self, name)
            _check_int_list("encoder_cuda_graph_config", name, value)
            if value is not None:
                object.__setattr__(self, name, tuple(sorted(set(value))))


_NESTED = {
    "kv_cache_config": KvCacheConfig,
    "scheduler_config": SchedulerConfig,
    "cuda_graph_config": CudaGraphConfig,
    "encoder_cuda_graph_config": EncodeCudaGraphConfig,
    "tuning": TuningConfig,
}


@dataclass(frozen=True)
class LlmArgs:
    """Every option of ``LLM(...)`` (and of the YAML config), validated."""

    model: str = ""
    tokenizer: Any = None
    backend: str = "pytorch"
    attn_backend: str = "auto"            # auto: triton on CUDA, torch on CPU
    dtype: str = "auto"
    device: str = "auto"
    max_batch_size: int = 128
    max_input_len: int | None = None      # default 1024 for text, 1500 for Whisper
    max_num_tokens: int = 8192
    max_seq_len: int | None = None
    max_beam_width: int = 1
    encoder_max_batch_size: int | None = None
    encoder_max_num_tokens: int | None = None
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    # On by default (padded grid up to max_batch_size); None (YAML null) turns decoder graphs off.
    cuda_graph_config: CudaGraphConfig | None = field(default_factory=lambda: CudaGraphConfig(enable_padding=True))
    encoder_cuda_graph_config: EncodeCudaGraphConfig | None = field(
        default_factory=lambda: EncodeCudaGraphConfig(enable_padding=True))
    # False: a step that encodes new requests runs its decoder half eagerly (graphs elsewhere).
    enable_encoder_decoder_mixed_cuda_graph: bool = True
    # Unset: overlap where the device runs asynchronously (CUDA), not on the CPU, where launch
    # computes the step before it returns: there it would only deliver every token a step late.
    # false forces it on (the CPU tests exercise its bookkeeping that way).
    disable_overlap_scheduler: bool | None = None
    enable_chunked_prefill: bool = False
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    tensor_parallel_size: int = 1
    # Replicas of the whole engine (each on tensor_parallel_size GPUs of its own), each in its
    # own process behind one front (``enc2dec.engine.data_parallel``).
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    enable_attention_dp: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False       # passed to transformers' config and tokenizer loading
    seed: int = 0
    # True: the engine core steps in its own process and this one only submits and receives
    # (``enc2dec.engine.engine_process``); serve turns it on, the library API keeps one process.
    engine_process: bool = False
    tuning: TuningConfig = field(default_factory=TuningConfig)

    def __post_init__(self):
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, _from_dict(cls, value, name))
            elif value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be a {cls.__name__} or a mapping, got {type(value).__name__}")
        if self.tuning is None:
            raise ValueError("tuning must be a TuningConfig or a mapping (omit it for the defaults), got None")
        object.__setattr__(self, "tuning", self.tuning.with_env(os.environ))
        for name in ("enable_encoder_decoder_mixed_cuda_graph", "trust_remote_code", "engine_process"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.disable_overlap_scheduler is not None and not isinstance(self.disable_overlap_scheduler, bool):
            raise ValueError(f"disable_overlap_scheduler must be true, false or null (unset: on for CUDA, off on the "
                             f"CPU), got {self.disable_overlap_scheduler!r}")
        if self.backend != "pytorch":
            raise ValueError(f"backend={self.backend!r} is not supported; valid: pytorch")
        if self.attn_backend != "auto":
            canonical_backend_name(self.attn_backend)   # raises naming the valid choices
        dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in VALID_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not valid; valid: {', '.join(VALID_DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not valid; valid: auto, cpu, cuda, cuda:N")
        for name in ("max_batch_size", "max_num_tokens", "max_beam_width", "tensor_parallel_size",
                     "data_parallel_size"):
            _check_positive_int("LLM", name, getattr(self, name))
        if self.data_parallel_size > 1 and str(self.device).startswith("cuda:"):
            raise ValueError(f"device={self.device!r} with data_parallel_size={self.data_parallel_size}: replica i "
                             "runs on its own GPUs (i x tensor_parallel_size onwards); choose the GPUs with "
                             "CUDA_VISIBLE_DEVICES and use device='cuda' or 'auto'")
        for name in ("max_input_len", "max_seq_len", "encoder_max_batch_size", "encoder_max_num_tokens"):
            _check_positive_int("LLM", name, getattr(self, name), allow_none=True)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not valid; valid: auto, dummy")
        if self.pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size must be 1: pipeline parallelism is not supported for "
                             "encoder-decoder models (use tensor_parallel_size)")
        if self.context_parallel_size != 1:
            raise ValueError("context_parallel_size must be 1: context parallelism is not supported for "
                             "encoder-decoder models")
        if self.enable_attention_dp:
            raise ValueError("enable_attention_dp must be False: attention data parallelism is not supported "
                             "for encoder-decoder models")
        if self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill must be False: the encoder phase cannot be chunked; "
                             "raise max_num_tokens / encoder_max_num_tokens instead")
        if self.max_beam_width > self.max_batch_size:
            raise ValueError(f"max_beam_width ({self.max_beam_width}) must not exceed max_batch_size "
                             f"({self.max_batch_size}): every beam is a decoder sequence")
        if self.kv_cache_config.use_kv_cache_manager_v2 and self.max_beam_width > 1:
            raise ValueError("kv_cache_config.use_kv_cache_manager_v2=True requires max_beam_width=1")
        if self.encoder_max_batch_size is not None and self.encoder_max_batch_size > self.max_batch_size:
            raise ValueError(f"encoder_max_batch_size ({self.encoder_max_batch_size}) must not exceed "
                             f"max_batch_size ({self.max_batch_size})")

    @staticmethod
    def from_dict(data: dict, **overrides) -> "LlmArgs":
        merged = {**(data or {}), **{k: v for k, v in overrides.items() if v is not None}}
        names = {f.name for f in dataclasses.fields(LlmArgs)}
        for key in merged:
            if key not in names:
                raise _unknown_key_error("config", key, names)
        return LlmArgs(**merged)

    @staticmethod
    def from_yaml(path: str, **overrides) -> "LlmArgs":
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ValueError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of option names to values")
        return LlmArgs.from_dict(data, **overrides)
