"""Incremental text equals the full decode; stop strings cut the text where they match."""
import pytest
from transformers import ByT5Tokenizer

from enc2dec.engine.inputs.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return ByT5Tokenizer()


def _stream(detok, ids):
    pieces = [detok.update(ids[:i]) for i in range(1, len(ids) + 1)]
    pieces.append(detok.finish(ids))
    return pieces


def test_streamed_pieces_join_to_the_full_text_with_multibyte_chars(tok):
    text = "Grüße aus Köln, 日本語 and more text after the window"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    assert "".join(pieces) == text
    assert detok.text == text
    assert all("\ufffd" not in p for p in pieces)       # never a half character


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tok, include):
    text = "alpha beta STOP gamma"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["STOP"], include_stop_str_in_output=include)
    pieces = _stream(detok, ids)
    assert detok.stop_matched == "STOP"
    expected = "alpha beta STOP" if include else "alpha beta "
    assert detok.text == expected
    assert "".join(pieces) == expected


def test_no_tokenizer_gives_empty_text():
    detok = IncrementalDetokenizer(None)
    assert detok.update([1, 2, 3]) == "" and detok.finish([1, 2, 3]) == "" and detok.text == ""


@pytest.mark.real
@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_level_bpe_streams_the_full_decode(real_whisper, chunk):
    # Whisper's byte-level BPE splits a character across tokens and decodes its window with
    # the prefix it was given; streamed pieces must still join to exactly the full decode.
    from transformers import AutoTokenizer

    bpe = AutoTokenizer.from_pretrained(real_whisper.base)
    text = " Grüße aus Köln, 日本語の文章 and then a long English tail that runs past several windows " * 3
    ids = bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe)
    pieces = [detok.update(ids[:i]) for i in range(chunk, len(ids) + chunk, chunk)]
    pieces.append(detok.finish(ids))
    assert "".join(pieces) == bpe.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)


class _CleanupTokenizer:
    """Decodes a lone token with a leading space, as sentencepiece-style tokenizers may, but a whole
    list with the first space stripped: the final decode then does not extend the streamed text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" for i in ids)[1 if len(ids) > 3 else 0:]


def test_a_final_decode_that_rewrites_the_stream_is_flagged_and_given_whole():
    detok = IncrementalDetokenizer(_CleanupTokenizer())
    ids = [1, 2, 3, 4, 5]
    streamed = "".join(detok.add([i]) for i in ids[:2])
    assert streamed == " w1 w2" and not detok.rewritten
    last = detok.finish(ids)
    assert detok.rewritten and last == detok.text == "w1 w2 w3 w4 w5"


@pytest.mark.parametrize("family", ["flan_t5", "bart", "mbart", "whisper"])
@pytest.mark.parametrize("skip", [True, False])
def test_the_direct_decode_is_the_tokenizers_own_decode(family, skip, request):
    # Streams decode through the Rust tokenizer directly where the class adds nothing to it:
    # the text must be what tokenizer.decode gives, special tokens, odd ids and all.
    import random

    from transformers import AutoTokenizer

    from enc2dec.engine.inputs.detokenizer import plain_decoder

    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(family))
    decode = plain_decoder(tok, skip)
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    if family == "whisper":     # timestamp tokens (filtered from the text) and the prompt marker (strips a prompt)
        special += tok.convert_tokens_to_ids(["<|0.00|>", "<|7.40|>", "<|30.00|>", "<|startofprev|>"])
    text_ids = tok.encode("Grüße aus Köln, the cat sat on the mat. 日本語!", add_special_tokens=False)
    for _ in range(400):
        ids = [rng.choice(special) if special and rng.random() < 0.2 else
               rng.choice(text_ids) if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 16))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids
    # Every family takes a direct path: the Rust call itself where the class adds nothing to it,
    # Whisper's filtered Rust call otherwise; none goes through tokenizer.decode.
    if family != "whisper":
        assert decode.func == tok.backend_tokenizer.decode
    assert getattr(decode, "func", None) != tok.decode


def test_a_tokenizer_whose_decode_differs_from_the_direct_call_keeps_its_decode(flan_t5):
    # A class that changes decode's text in a way no direct path redoes keeps its own decode, so
    # a stream's text never drifts from what decode() gives.
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    from enc2dec.engine.inputs.detokenizer import IncrementalDetokenizer, plain_decoder

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    tok = Shouting(tokenizer_file=str(Path(flan_t5) / "tokenizer.json"), clean_up_tokenization_spaces=False)
    decode = plain_decoder(tok, True)
    assert decode.func == tok.decode
    ids = tok.encode("the cat sat on the mat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in ids) + detok.finish(ids)
    assert streamed == "THE CAT SAT ON THE MAT" and not detok.rewritten


def test_whisper_streams_drop_timestamp_tokens_and_prompts_as_decode_does(whisper):
    # Whisper's decode removes the timestamp tokens' text and, skipping special tokens, a prompt
    # (<|startofprev|> ... <|startoftranscript|>): a stream fed those ids gives decode's text.
    from transformers import AutoTokenizer

    from enc2dec.engine.inputs.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(whisper)
    ts = tok.convert_tokens_to_ids(["<|0.00|>", "<|1.20|>", "<|2.40|>"])
    words = tok.encode(" the cat sat on the mat, then it slept", add_special_tokens=False)
    prompt = tok.convert_tokens_to_ids(["<|startofprev|>"]) + tok.encode(" earlier words", add_special_tokens=False)
    sot = tok.convert_tokens_to_ids(["<|startoftranscript|>"])
    for ids in ([ts[0]] + words[:5] + [ts[1], ts[1]] + words[5:] + [ts[2]], prompt + sot + words):
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add([i]) for i in ids) + detok.finish(ids)
        assert streamed == detok.text == tok.decode(ids, skip_special_tokens=True), ids
        assert "<|" not in streamed and not detok.rewritten
