"""Tiny random checkpoints of every family, written with transformers ``save_pretrained``
together with a working tokenizer trained offline on a few lines of text.

Every builder takes a folder and returns it, ready for ``AutoConfig`` / ``AutoTokenizer``
/ ``from_pretrained`` and for our loader. Weights are float32 and re-drawn with a larger
spread than transformers' init (which zeroes biases), so a weight mapped to the wrong
place changes the logits. Storage formats differ on purpose: sharded safetensors (flan_t5),
pytorch_model.bin (t5_relu), single safetensors (the rest).
"""
from __future__ import annotations

import json
import os

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "machine translation is fun and useful",
    "summarize: studies have shown that owning a dog is good for you",
    "un chat noir dort sur le canapé",
    "translate English to German: the house is wonderful",
    "Numbers like 1234 and 56.78 appear too!",
] * 4

WHISPER_SPECIALS = [
    "<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
    "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>",
]


# ---- tokenizers --------------------------------------------------------------------------

def _unigram_vocab(special: list[str], vocab_size: int = 120) -> list[tuple[str, float]]:
    """SentencePiece-style (metaspace) unigram pieces with scores; specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special,
                                                            unk_token="<unk>"))
    return [tuple(p) for p in json.loads(tok.to_str())["model"]["vocab"]]


def _byte_bpe(special: list[str], vocab_size: int = 300) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2 style byte-level BPE (BART, Whisper); specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def t5_tokenizer():
    from transformers import T5Tokenizer

    # T5 ids: <pad>=0, </s>=1, <unk>=2
    return T5Tokenizer(vocab=_unigram_vocab(["<pad>", "</s>", "<unk>"]), extra_ids=0)


def bart_tokenizer():
    from transformers import BartTokenizer

    vocab, merges = _byte_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])   # BART ids 0..4
    return BartTokenizer(vocab=vocab, merges=merges)


def mbart_tokenizer():
    from transformers import MBart50Tokenizer

    # Specials in SentencePiece order; the tokenizer reorders them fairseq-style and appends
    # the 52 language codes (en_XX, ro_RO, ...) and <mask>.
    return MBart50Tokenizer(vocab=_unigram_vocab(["<unk>", "<s>", "</s>"]), src_lang="en_XX")


def whisper_tokenizer():
    from transformers import AddedToken, WhisperTokenizer

    vocab, merges = _byte_bpe([])
    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in WHISPER_SPECIALS[1:]]})
    return tok


# ---- checkpoints -------------------------------------------------------------------------

@torch.no_grad()
def _randomize(model, seed: int) -> None:
    """Redraw every parameter and buffer so biases, norms and position tables matter."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=gen) * 0.1
        t.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)


def _save(model, tokenizer, folder: str, as_bin: bool = False, **save_kwargs) -> str:
    model.save_pretrained(folder, **save_kwargs)
    if as_bin:
        # transformers 5 writes safetensors only; an old-style checkpoint keeps every tied
        # name (shared, encoder/decoder embed_tokens, lm_head) in one pytorch_model.bin.
        os.remove(os.path.join(folder, "model.safetensors"))
        torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    tokenizer.save_pretrained(folder)
    return folder


def build_t5_relu(folder: str) -> str:
    """T5 v1.0: relu MLP, tied embeddings (logits scaled by d_model**-0.5), saved as .bin."""
    from transformers import T5Config, T5ForConditionalGeneration

    tok = t5_tokenizer()
    # A small max_distance makes short test sequences reach the log-spaced and saturated buckets.
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   feed_forward_proj="relu", relative_attention_num_buckets=8, relative_attention_max_distance=12,
                   tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg).eval()
    _randomize(model, 1)
    return _save(model, tok, folder, as_bin=True)


def build_flan_t5(folder: str) -> str:
    """Flan-T5 / v1.1: gated-gelu, more decoder than encoder layers, inner dim != d_model,
    untied LM head, saved as sharded safetensors.

    transformers 5.24 ``generate()`` fails on this shape (its DynamicCache is sized by
    num_layers, not num_decoder_layers): a reference run needs ``use_cache=False``."""
    from transformers import T5Config, T5ForConditionalGeneration

    tok = t5_tokenizer()
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=48, num_layers=2, num_decoder_layers=3,
                   num_heads=4, feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                   relative_attention_max_distance=12, tie_word_embeddings=False,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg).eval()
    _untie_lm_head(model)
    _randomize(model, 2)
    return _save(model, tok, folder, max_shard_size="40KB")


def _untie_lm_head(model) -> None:
    # transformers 5 always ties T5's head at init; Flan checkpoints carry their own.
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone())


def build_byt5(folder: str) -> str:
    """ByT5: T5 v1.1 over bytes (vocab 384 as in the real checkpoints); its tokenizer needs no files."""
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=1, num_heads=4,
                   feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                   relative_attention_max_distance=12, tie_word_embeddings=False,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg).eval()
    _untie_lm_head(model)
    _randomize(model, 3)
    return _save(model, ByT5Tokenizer(), folder)


def _set_generation(model, **kwargs) -> None:
    for k, v in kwargs.items():
        setattr(model.generation_config, k, v)


def build_bart(folder: str) -> str:
    """BART: post-norm, learned positions (offset 2), final_logits_bias, forced BOS 0."""
    from transformers import BartConfig, BartForConditionalGeneration

    tok = bart_tokenizer()
    cfg = BartConfig(vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=128, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=2)
    model = BartForConditionalGeneration(cfg).eval()
    _randomize(model, 4)
    _set_generation(model, forced_bos_token_id=0, decoder_start_token_id=2)
    return _save(model, tok, folder)


def build_mbart(folder: str) -> str:
    """mBART-50: pre-norm, scaled embeddings, language-code tokenizer, forced BOS en_XX."""
    from transformers import MBartConfig, MBartForConditionalGeneration

    tok = mbart_tokenizer()
    en_xx = tok.convert_tokens_to_ids("en_XX")
    cfg = MBartConfig(vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      max_position_embeddings=128, activation_function="relu", scale_embedding=True,
                      bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    model = MBartForConditionalGeneration(cfg).eval()
    _randomize(model, 5)
    _set_generation(model, forced_bos_token_id=en_xx, decoder_start_token_id=2)
    return _save(model, tok, folder)


def build_whisper(folder: str, timestamps: bool = False) -> str:
    """Whisper with real geometry on the audio side (80 mels, 3000 frames -> 1500 positions)
    and a tiny d_model, plus generation config and feature extractor. ``timestamps``: the
    vocabulary also holds Whisper's 1501 timestamp ids after ``<|notimestamps|>`` (ids only:
    the tokenizer has no text for them, so decode with ``detokenize=False``)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = whisper_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in WHISPER_SPECIALS}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    assert ids["<|notimestamps|>"] == len(tok) - 1      # the timestamps follow it
    cfg = WhisperConfig(vocab_size=len(tok) + (1501 if timestamps else 0), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=32,
                        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
                        begin_suppress_tokens=[eot], suppress_tokens=[ids["<|startoflm|>"]])
    model = WhisperForConditionalGeneration(cfg).eval()
    _randomize(model, 6)
    _set_generation(
        model, decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        suppress_tokens=[ids["<|startoflm|>"], ids["<|startofprev|>"]], begin_suppress_tokens=[eot],
        no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=True, max_length=32,
        lang_to_id={"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]})
    _save(model, tok, folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return folder


BUILDERS = {
    "t5_relu": build_t5_relu,
    "flan_t5": build_flan_t5,
    "byt5": build_byt5,
    "bart": build_bart,
    "mbart": build_mbart,
    "whisper": build_whisper,
    "whisper_ts": lambda folder: build_whisper(folder, timestamps=True),
}


def build(name: str, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    return BUILDERS[name](folder)
