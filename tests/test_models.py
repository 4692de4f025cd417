"""Model-level parity with transformers in float32, through the paged KV cache.

Each family's tiny checkpoint is loaded by our loader, run with the torch backend over a
batch of mixed-length inputs (non-contiguous blocks of 4 slots, sequences joining at
different steps with multi-token first steps, then one token per step), and its encoder
states and teacher-forced logits are compared with the transformers model.
"""
from __future__ import annotations

import json
import math
import os
import wave

import numpy as np
import pytest
import torch

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, KVCache, TorchAttentionBackend
from enc2dec.engine.inputs.known_configs import get_known_config
from enc2dec.engine.runner.loader import find_weight_files, load_model
from enc2dec.engine.models import ARCHITECTURES, get_model_class

TOKENS_PER_BLOCK = 4
ATOL = 1e-4


def _slot(blocks: list[int], pos: int) -> int:
    return blocks[pos // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + pos % TOKENS_PER_BLOCK


def _pad(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _cumsum0(xs: list[int]) -> list[int]:
    return [0] + np.cumsum(xs).tolist()


def _blocks_for(lengths: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Shuffled block ids (block 0 left unused, as it pads the tables) split per sequence."""
    counts = [math.ceil(n / TOKENS_PER_BLOCK) for n in lengths]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    starts = _cumsum0(counts)
    return [ids[starts[i]:starts[i + 1]] for i in range(len(lengths))], sum(counts) + 1


def run_engine(model, enc_inputs, enc_lens: list[int], dec_ids: list[list[int]], first_lens: list[int],
               is_whisper: bool = False):
    """Encode, write cross K/V, decode teacher-forced. Sequence i joins at step i feeding its
    first ``first_lens[i]`` tokens, then one per step. Returns (enc_hidden, [logits [L_i, V]])."""
    gen = torch.Generator().manual_seed(0)
    self_blocks, num_self = _blocks_for([len(d) for d in dec_ids], gen)
    cross_blocks, num_cross = _blocks_for(enc_lens, gen)
    kv = KVCache.allocate(model.num_decoder_layers, model.num_decoder_heads, model.decoder_head_dim,
                          TOKENS_PER_BLOCK, num_self, num_cross, torch.float32, "cpu")
    enc_meta = EncoderMetadata(
        cu_seqlens=torch.tensor(_cumsum0(enc_lens), dtype=torch.int32), seq_lens=enc_lens,
        positions=None if is_whisper else torch.cat([torch.arange(n) for n in enc_lens]),
        cross_slot_mapping=torch.tensor([_slot(b, p) for b, n in zip(cross_blocks, enc_lens) for p in range(n)]))
    enc_hidden = model.encode(enc_inputs, enc_meta)
    model.write_cross_kv(enc_hidden, enc_meta, kv)

    done = [0] * len(dec_ids)
    logits: list[list[torch.Tensor]] = [[] for _ in dec_ids]
    step = 0
    while any(d < len(ids) for d, ids in zip(done, dec_ids)):
        active = [i for i in range(len(dec_ids)) if i <= step and done[i] < len(dec_ids[i])]
        q_lens = [first_lens[i] if done[i] == 0 else 1 for i in active]
        positions = [p for i, q in zip(active, q_lens) for p in range(done[i], done[i] + q)]
        seq_lens = [done[i] + q for i, q in zip(active, q_lens)]
        meta = DecoderMetadata(
            query_start_loc=torch.tensor(_cumsum0(q_lens), dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=_pad([self_blocks[i] for i in active]),
            slot_mapping=torch.tensor([_slot(self_blocks[i], p) for i, q in zip(active, q_lens)
                                       for p in range(done[i], done[i] + q)]),
            cross_block_tables=_pad([cross_blocks[i] for i in active]),
            enc_lens=torch.tensor([enc_lens[i] for i in active], dtype=torch.int32),
            query_lens_host=q_lens, seq_lens_host=seq_lens, enc_lens_host=[enc_lens[i] for i in active],
            last_token_indices=torch.tensor(_cumsum0(q_lens)[1:]) - 1)
        input_ids = torch.tensor([t for i, q in zip(active, q_lens) for t in dec_ids[i][done[i]:done[i] + q]])
        hidden = model.decode(input_ids, torch.tensor(positions), meta, kv)     # [N, d]
        out = model.compute_logits(hidden)                                        # [N, V]
        assert out.dtype == torch.float32
        for i, chunk in zip(active, out.split(q_lens)):
            logits[i].append(chunk)
        for i, q in zip(active, q_lens):
            done[i] += q
        step += 1
    return enc_hidden, [torch.cat(x) for x in logits]


def _hf_model(folder):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    is_speech = AutoConfig.from_pretrained(folder).model_type == "whisper"
    cls = AutoModelForSpeechSeq2Seq if is_speech else AutoModelForSeq2SeqLM
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


FAMILIES = ["t5_relu", "flan_t5", "byt5", "bart", "mbart", "whisper"]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_matches_transformers(family, request):
    folder = request.getfixturevalue(family)
    hf = _hf_model(folder)
    model = load_model(folder, hf.config, TorchAttentionBackend(), torch.float32, "cpu")
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    is_whisper = family == "whisper"
    if is_whisper:
        feats = torch.randn(2, hf.config.num_mel_bins, 3000, generator=gen)     # [B, n_mels, frames]
        enc_lens = [1500, 1500]
        per_seq_inputs = list(feats)
        enc_inputs = feats
        dec_lens, first_lens = [7, 11], [4, 1]
    else:
        enc_lens = [7, 20, 13]       # 20 > relative_attention_max_distance: saturated T5 buckets
        per_seq_inputs = [torch.randint(3, vocab, (n,), generator=gen) for n in enc_lens]
        enc_inputs = torch.cat(per_seq_inputs)
        dec_lens, first_lens = [9, 15, 6], [1, 3, 2]
    start = hf.config.decoder_start_token_id
    dec_ids = [[start] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in dec_lens]

    enc_hidden, logits = run_engine(model, enc_inputs, enc_lens, dec_ids, first_lens, is_whisper)

    offsets = _cumsum0(enc_lens)
    for i, (x, ids) in enumerate(zip(per_seq_inputs, dec_ids)):
        kwargs = {"input_features": x[None]} if is_whisper else {"input_ids": x[None]}
        ref_enc = hf.get_encoder()(**kwargs).last_hidden_state                 # [1, T_i, d]
        torch.testing.assert_close(enc_hidden[offsets[i]:offsets[i + 1]], ref_enc[0], atol=ATOL, rtol=0)
        ref = hf(encoder_outputs=(ref_enc,), decoder_input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_tokenizer_round_trips_offline(family, request):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(folder)
    text = "hello world, the fox"
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True).strip() == text
    assert max(ids) < AutoConfig.from_pretrained(folder).vocab_size
    gen = GenerationConfig.from_pretrained(folder)
    if family == "mbart":
        assert ids[0] == tok.convert_tokens_to_ids("en_XX")            # source language code first
        assert AutoTokenizer.from_pretrained(folder, src_lang="ro_RO")(text).input_ids[0] == \
            tok.convert_tokens_to_ids("ro_RO")
        assert gen.forced_bos_token_id == tok.convert_tokens_to_ids("en_XX")
    if family == "bart":
        assert gen.forced_bos_token_id == 0
    if family == "whisper":
        specials = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>",
                    "<|endoftext|>"]
        vocab = tok.get_vocab()
        assert all(t in vocab for t in specials) and len({vocab[t] for t in specials}) == len(specials)
        assert gen.decoder_start_token_id == tok.convert_tokens_to_ids("<|startoftranscript|>")
        assert gen.suppress_tokens and gen.begin_suppress_tokens


def test_checkpoint_formats_are_exercised(flan_t5, t5_relu):
    # The parity test above loads these through the sharded-index and .bin paths.
    shards = find_weight_files(flan_t5)
    assert len(shards) > 1 and all(s.endswith(".safetensors") for s in shards)
    assert [os.path.basename(p) for p in find_weight_files(t5_relu)] == ["pytorch_model.bin"]


def test_unsupported_architecture_lists_supported():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported") as e:
        get_model_class(GPT2Config(architectures=["GPT2LMHeadModel"]))
    for arch in ARCHITECTURES:
        assert arch in str(e.value)


def test_t5_config_without_architectures_uses_model_type():
    from transformers import T5Config

    assert get_model_class(T5Config(architectures=None)) is ARCHITECTURES["T5ForConditionalGeneration"]


def test_missing_weights_are_named(tmp_path, bart):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(bart, name), "rb").read())
    state = load_file(os.path.join(bart, "model.safetensors"))
    del state["model.decoder.layers.1.encoder_attn.v_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.encoder_attn\.kv\.weight\[shard 1\]"):
        load_model(str(tmp_path), None, None, torch.float32, "cpu")


def test_folder_without_weights_is_named(tmp_path, bart):
    (tmp_path / "config.json").write_bytes(open(os.path.join(bart, "config.json"), "rb").read())
    with pytest.raises(FileNotFoundError, match=f"no weights found in {tmp_path}"):
        load_model(str(tmp_path), None, None, torch.float32, "cpu")


def test_bad_load_format_is_named(bart):
    with pytest.raises(ValueError, match="load_format='gguf' is not supported; valid: auto, dummy"):
        load_model(bart, None, None, torch.float32, "cpu", load_format="gguf")


@pytest.mark.parametrize("name, enc_len", [("openai/whisper-tiny", 1000), ("google/flan-t5-small", 8)])
@torch.no_grad()
def test_dummy_known_config_runs_in_bf16(name, enc_len):
    config = get_known_config(name)
    model = load_model(None, config, TorchAttentionBackend(), torch.bfloat16, "cpu", load_format="dummy")
    assert next(model.parameters()).dtype == torch.bfloat16
    if config.model_type == "whisper":
        enc_inputs = torch.randn(1, config.num_mel_bins, 2 * enc_len)           # short audio: fewer frames
        enc_lens, is_whisper = [enc_len], True
    else:
        enc_inputs, enc_lens, is_whisper = torch.arange(3, 3 + enc_len), [enc_len], False
    enc_hidden, (logits,) = run_engine(model, enc_inputs, enc_lens, [[config.decoder_start_token_id, 5, 6]], [2],
                                       is_whisper)
    assert enc_hidden.shape == (enc_len, config.d_model)
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0            # random weights give token-dependent logits, not a constant


def test_dummy_weights_are_seeded_and_sane(whisper):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(whisper)
    a, b = (load_model(None, config, None, torch.float32, "cpu", load_format="dummy") for _ in range(2))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    layer = a.decoder.layers[0]
    assert torch.all(layer.final_layer_norm.weight == 1) and torch.all(layer.self_attn.qkv.bias == 0)
    assert abs(layer.mlp.fc1.weight.std().item() - 0.02) < 0.002


def _read_wav(path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0


@pytest.mark.real
@torch.no_grad()
def test_real_whisper_tiny_en_matches_transformers(real_whisper):
    """Real weights have larger activations than random ones: check the greedy transcript's
    logits on real speech, and that the argmax agrees token for token."""
    from transformers import WhisperFeatureExtractor

    folder = str(real_whisper.tiny_en)
    hf = _hf_model(folder)
    model = load_model(folder, hf.config, TorchAttentionBackend(), torch.float32, "cpu")
    clip = json.loads(real_whisper.manifest.read_text().splitlines()[0])
    audio = _read_wav(real_whisper.manifest.parent / clip["audio"])
    feats = WhisperFeatureExtractor.from_pretrained(folder)(audio, sampling_rate=16000,
                                                            return_tensors="pt").input_features
    prompt = [hf.generation_config.decoder_start_token_id, hf.generation_config.no_timestamps_token_id]
    out = hf.generate(feats, decoder_input_ids=torch.tensor([prompt]), max_new_tokens=12)[0].tolist()
    greedy = out if out[:len(prompt)] == prompt else prompt + out      # some versions drop the prompt
    enc_hidden, (logits,) = run_engine(model, feats, [1500], [greedy], [len(prompt)], is_whisper=True)
    ref_enc = hf.get_encoder()(input_features=feats).last_hidden_state[0]
    torch.testing.assert_close(enc_hidden, ref_enc, atol=2e-3, rtol=1e-4)
    ref = hf(encoder_outputs=(ref_enc[None],), decoder_input_ids=torch.tensor([greedy])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-4)
    assert logits.argmax(-1)[len(prompt) - 1:-1].tolist() == greedy[len(prompt):]


@pytest.mark.parametrize("family", ["flan_t5", "bart", "whisper"])
def test_loading_a_checkpoint_does_not_import_torch_dynamo_or_sympy(family, request):
    """Building on the meta device skips the embeddings' random init: a meta ``normal_`` runs
    PyTorch's Python reference, whose first call imports torch._dynamo (over a second of every
    start on two cores) only for the values to be overwritten by the checkpoint. Moving the model
    off the meta device with ``to_empty`` would import sympy the same way (0.29 s of a one-file
    ``enc2dec transcribe`` on 2 cores)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from enc2dec.engine.runner.loader import load_model\n"
            f"model = load_model({request.getfixturevalue(family)!r})\n"
            "assert all(not p.is_meta for p in model.parameters())\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"]
