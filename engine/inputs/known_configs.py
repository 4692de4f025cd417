"""Configs of well-known checkpoints, so ``load_format="dummy"`` needs no download.

The values are those of each checkpoint's config.json and generation_config.json.
transformers >= 5 drops generation-only keys (``forced_bos_token_id``, Whisper's
``no_timestamps_token_id``...) from model configs: ``get_known_generation_config`` returns
them all, and ``get_known_config`` also sets them as config attributes (as transformers 4
kept them), so ``GenerationConfig.from_model_config`` still sees ``forced_bos_token_id``.
"""
from __future__ import annotations


def _flan_t5(d_model: int, d_ff: int, num_heads: int, num_layers: int) -> dict:
    return dict(
        model_type="t5", architectures=["T5ForConditionalGeneration"],
        d_model=d_model, d_ff=d_ff, d_kv=64, num_heads=num_heads,
        num_layers=num_layers, num_decoder_layers=num_layers,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6, vocab_size=32128, tie_word_embeddings=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


def _bart_large(vocab_size: int, **extra) -> dict:
    return dict(
        d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
        max_position_embeddings=1024, vocab_size=vocab_size,
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
        **extra,
    )


# Whisper's generation-time suppress list (multilingual v1/v2 vocabulary of 51865 tokens);
# large-v3 adds one language token, so its special tokens from <|translate|> on shift by one.
_SUPPRESS_PREFIX = [
    1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93, 359, 503, 522,
    542, 873, 893, 902, 918, 922, 931, 1350, 1853, 1982, 2460, 2627, 3246, 3253, 3268, 3536, 3846, 3961,
    4183, 4667, 6585, 6647, 7273, 9061, 9383, 10428, 10929, 11938, 12033, 12331, 12562, 13793, 14157,
    14635, 15265, 15618, 16553, 16604, 18362, 18956, 20075, 21675, 22520, 26130, 26161, 26435, 28279,
    29464, 31650, 32302, 32470, 36865, 42863, 47425, 49870, 50254, 50258,
]
_SUPPRESS_V2 = _SUPPRESS_PREFIX + [50358, 50359, 50360, 50361, 50362]
_SUPPRESS_V3 = _SUPPRESS_PREFIX + [50359, 50360, 50361, 50362, 50363]


# Whisper's language tokens in id order from 50259 (openai/whisper's tokenizer.py order; large-v3
# adds Cantonese, "yue", as the 100th).
_WHISPER_LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()


def _whisper(d_model: int, layers: int, heads: int, num_mel_bins: int = 80, vocab_size: int = 51865,
             pad_token_id: int = 50257, v3: bool = False, decoder_layers: int | None = None) -> dict:
    num_languages = 100 if v3 else 99
    special = 50259 + num_languages              # first token after the language tokens
    return dict(
        model_type="whisper", architectures=["WhisperForConditionalGeneration"],
        d_model=d_model, encoder_layers=layers, decoder_layers=decoder_layers or layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model,
        num_mel_bins=num_mel_bins, vocab_size=vocab_size,
        max_source_positions=1500, max_target_positions=448, activation_function="gelu",
        bos_token_id=50257, eos_token_id=50257, pad_token_id=pad_token_id, decoder_start_token_id=50258,
        suppress_tokens=list(_SUPPRESS_V3 if v3 else _SUPPRESS_V2), begin_suppress_tokens=[220, 50257],
        tie_word_embeddings=True,
        # generation_config.json: every language token, so language detection has its real choice
        max_length=448, is_multilingual=True,
        lang_to_id={f"<|{code}|>": 50259 + i for i, code in enumerate(_WHISPER_LANGUAGES[:num_languages])},
        task_to_id={"translate": special, "transcribe": special + 1}, no_timestamps_token_id=special + 5,
    )


def _t5(d_model: int, d_ff: int, num_heads: int, num_layers: int, **extra) -> dict:
    """The original T5 (v1.0): ReLU feed-forward, input and output embeddings tied."""
    return dict(
        model_type="t5", architectures=["T5ForConditionalGeneration"],
        d_model=d_model, d_ff=d_ff, d_kv=64, num_heads=num_heads, num_layers=num_layers,
        num_decoder_layers=num_layers, feed_forward_proj="relu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128, layer_norm_epsilon=1e-6, vocab_size=32128, n_positions=512,
        tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **extra,
    )


_CONFIGS: dict[str, dict] = {
    "google/flan-t5-small": _flan_t5(512, 1024, 6, 8),
    "google/flan-t5-base": _flan_t5(768, 2048, 12, 12),
    "google/flan-t5-large": _flan_t5(1024, 2816, 16, 24),
    "google/flan-t5-xl": _flan_t5(2048, 5120, 32, 24),
    "google-t5/t5-base": _t5(768, 3072, 12, 12),
    # ByT5: bytes as tokens (3 specials + 256 bytes, padded to 384), a deep encoder and a shallow decoder
    "google/byt5-small": dict(_flan_t5(1472, 3584, 6, 12), vocab_size=384, num_decoder_layers=4),
    "facebook/bart-large": dict(
        # config.json names BartModel; the same weights load as the generation class
        model_type="bart", architectures=["BartForConditionalGeneration"],
        **_bart_large(50265, activation_function="gelu", scale_embedding=False, forced_bos_token_id=0),
    ),
    "facebook/bart-large-cnn": dict(
        model_type="bart", architectures=["BartForConditionalGeneration"],
        **_bart_large(50264, activation_function="gelu", scale_embedding=False, forced_bos_token_id=0),
    ),
    "facebook/mbart-large-50-many-to-one-mmt": dict(
        model_type="mbart", architectures=["MBartForConditionalGeneration"],
        # forced BOS 250004 = en_XX, the single target language of this checkpoint
        **_bart_large(250054, activation_function="relu", scale_embedding=True, forced_bos_token_id=250004),
    ),
    "openai/whisper-tiny": _whisper(384, 4, 6),
    "openai/whisper-base": _whisper(512, 6, 8),
    "openai/whisper-small": _whisper(768, 12, 12),
    "openai/whisper-medium": _whisper(1024, 24, 16),
    "openai/whisper-large-v3": _whisper(1280, 32, 20, num_mel_bins=128, vocab_size=51866, pad_token_id=50256,
                                        v3=True),
    # large-v3's encoder with 4 (turbo, fine-tuned) or 2 (distil, distilled) decoder layers
    "openai/whisper-large-v3-turbo": _whisper(1280, 32, 20, num_mel_bins=128, vocab_size=51866, pad_token_id=50257,
                                              v3=True, decoder_layers=4),
    "distil-whisper/distil-large-v3": _whisper(1280, 32, 20, num_mel_bins=128, vocab_size=51866,
                                               pad_token_id=50256, v3=True, decoder_layers=2),
}
# Older hub names that still resolve to the same checkpoint.
_ALIASES = {"t5-base": "google-t5/t5-base"}

KNOWN_MODELS: list[str] = [*_CONFIGS, *_ALIASES]
_GENERATION_IDS = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "forced_eos_token_id",
                   "suppress_tokens", "begin_suppress_tokens")
_GENERATION_ONLY = ("forced_bos_token_id", "max_length", "is_multilingual", "lang_to_id", "task_to_id",
                    "no_timestamps_token_id")


def _lookup(name: str) -> tuple[str, dict, dict]:
    name = _ALIASES.get(name, name)
    key = name if name in _CONFIGS else next((k for k in _CONFIGS if k.split("/", 1)[1] == name), None)
    if key is None:
        raise ValueError(f"model {name!r} is not in the table of known configs; known: {', '.join(KNOWN_MODELS)}")
    values = dict(_CONFIGS[key])
    generation_only = {k: values.pop(k) for k in _GENERATION_ONLY if k in values}
    return key, values, generation_only


def get_known_config(name: str):
    """The transformers config of a well-known checkpoint (``org/name`` or just ``name``)."""
    from transformers import AutoConfig

    key, values, generation_only = _lookup(name)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    for k, v in generation_only.items():
        setattr(config, k, v)
    config.name_or_path = key
    return config


def get_known_generation_config(name: str):
    """What the checkpoint's generation_config.json holds (start/forced/special ids, suppress lists)."""
    from transformers import GenerationConfig

    _, values, generation_only = _lookup(name)
    ids = {k: values[k] for k in _GENERATION_IDS if values.get(k) is not None}
    return GenerationConfig(**ids, **generation_only)
