"""enc2dec eval's parts without a model: data formats, metrics, the parity rules, engine args."""
from __future__ import annotations

import json

import pytest
from enc2dec.eval import metrics
from enc2dec.eval.data import DataSpec, load_examples
from enc2dec.eval.errors import EvalInputError
from enc2dec.eval.options import EvalOptions
from enc2dec.eval.parity import canonical_hf_ids, first_difference, parity_stats
from enc2dec.eval.session import engine_args
from enc2dec.eval.tasks import TASKS

TRANSLATION = TASKS["translation"]
ROWS = [{"id": 1, "translation": {"de": "Guten Morgen", "en": "Good morning"}},
        {"id": 2, "translation": {"de": "Danke", "en": "Thank you"}}]


# ---- data ------------------------------------------------------------------------------------------

def _load(path, **kw):
    return load_examples(DataSpec(str(path), source_field=kw.pop("src", "translation.de"),
                                  target_field=kw.pop("tgt", "translation.en"), **kw), TRANSLATION)


def test_jsonl_and_json_array_with_dotted_fields(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    for name in ("d.jsonl", "d.json"):
        got = _load(tmp_path / name)
        assert [(e.source, e.reference) for e in got.examples] == [("Guten Morgen", "Good morning"),
                                                                   ("Danke", "Thank you")]
        assert got.num_rows == 2 and not got.bad_rows


def test_csv_tsv_and_parquet(tmp_path):
    (tmp_path / "d.csv").write_text('de,en\n"Guten Morgen, Welt",Good morning\nDanke,\n')
    (tmp_path / "d.tsv").write_text("de\ten\nGuten Morgen, Welt\tGood morning\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"de": ["Guten Morgen, Welt"], "en": ["Good morning"]}), tmp_path / "d.parquet")
    for name in ("d.csv", "d.tsv", "d.parquet"):
        got = _load(tmp_path / name, src="de", tgt="en")
        assert got.examples[0].source == "Guten Morgen, Welt" and got.examples[0].reference == "Good morning"
    csv = _load(tmp_path / "d.csv", src="de", tgt="en")
    assert [(b.row, b.kind) for b in csv.bad_rows] == [(1, "empty text")]


def test_unknown_file_type_and_empty_file_are_input_errors(tmp_path):
    (tmp_path / "d.txt").write_text("hello\n")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(EvalInputError, match="unknown file type"):
        _load(tmp_path / "d.txt")
    with pytest.raises(EvalInputError, match="holds no rows"):
        _load(tmp_path / "e.jsonl")


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "ds"))
    got = _load(tmp_path / "ds", split="test", limit=1)
    assert [e.source for e in got.examples] == ["Guten Morgen"] and got.num_rows == 1
    with pytest.raises(EvalInputError, match="no split 'validation'; splits: test"):
        _load(tmp_path / "ds", split="validation")


# ---- metrics ----------------------------------------------------------------------------------------

def test_text_metrics_on_known_pairs():
    same, _ = metrics.score(("bleu", "chrf"), ["the cat sat on the mat"], ["the cat sat on the mat"])
    assert same == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}
    none, notes = metrics.score(("bleu", "chrf"), ["zzz"], ["the cat sat on the mat"])
    assert none["bleu"] == pytest.approx(0.0) and notes["bleu"].startswith("nrefs:1")
    rouge, _ = metrics.score(TASKS["summarization"].metrics, ["the cat sat. It slept."],
                             ["the cat sat. It slept."])
    assert rouge == {k: pytest.approx(100.0) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")}


def test_wer_after_whisper_normalization():
    norm = metrics.whisper_normalizer(None, None, None)
    # Case, punctuation, "Mr." and digits are normalized away; one word of four is wrong.
    got, _ = metrics.score(("wer", "cer"), ["Mr. Smith walked 10 meters."], ["mister smith ran ten meters"], norm)
    assert got["wer"] == pytest.approx(1 / 5) and 0 < got["cer"] < 1


def test_normalizer_uses_the_checkpoints_spelling_map(tmp_path):
    (tmp_path / "normalizer.json").write_text(json.dumps({"colour": "color"}))
    norm = metrics.whisper_normalizer(str(tmp_path), None, "en")
    assert norm("The colour grey") == "the color grey" and "spelling map (normalizer.json, 1 entries)" in norm.name
    assert "BasicTextNormalizer" in metrics.whisper_normalizer(None, None, "de").name


# ---- parity -----------------------------------------------------------------------------------------

def test_canonical_ids_drop_padding_and_restore_whisper_eos():
    eos = frozenset({2})
    assert canonical_hf_ids([5, 6, 2, 0, 0], eos, 8, strips_eos=False) == [5, 6, 2]
    assert canonical_hf_ids([5, 6, 7], eos, 3, strips_eos=False) == [5, 6, 7]            # hit the limit
    assert canonical_hf_ids([5, 6], eos, 8, strips_eos=True) == [5, 6, 2]                # EOS stripped by HF
    assert canonical_hf_ids([5, 6, 7], eos, 3, strips_eos=True) == [5, 6, 7]


def test_first_difference_and_stats():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    stats = parity_stats([[1, 2], [1, 2, 3], [4]], [[1, 2], [1, 2], [5]], ["a", "b", "c"], ["a", "b", "d"]).as_dict()
    assert stats["exact_match"] == pytest.approx(1 / 3) and stats["text_exact_match"] == pytest.approx(2 / 3)
    assert (stats["first_diff_min"], stats["first_diff_mean"], stats["num_mismatched"]) == (0, 1.0, 2)


# ---- engine args ------------------------------------------------------------------------------------

def _engine_args(config=None, batch_size=16, **overrides):
    return engine_args(EvalOptions("translation", "m", batch_size=batch_size, config=config,
                                   engine_overrides=overrides))


def test_engine_args_default_cross_fraction_and_batch_size(tmp_path):
    args = _engine_args(dtype="float32")
    assert args.kv_cache_config.cross_kv_cache_fraction == 0.5 and args.max_batch_size == 16
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_batch_size: 64\nkv_cache_config:\n  cross_kv_cache_fraction: 0.3\n")
    args = _engine_args(str(cfg))
    assert args.kv_cache_config.cross_kv_cache_fraction == 0.3 and args.max_batch_size == 64
    assert _engine_args(str(cfg), max_batch_size=8).max_batch_size == 8   # the option wins
    cfg.write_text("max_batch_sise: 64\n")
    with pytest.raises(EvalInputError, match="Did you mean 'max_batch_size'"):
        _engine_args(str(cfg))


def test_t5_task_prefix_comes_from_the_checkpoint():
    from types import SimpleNamespace

    from enc2dec.eval.data import LoadedData
    from enc2dec.eval.session import _default_prefix

    cfg = SimpleNamespace(task_specific_params={"summarization": {"prefix": "summarize: "},
                                                "translation_en_to_de": {"prefix": "translate English to German: "}})
    data = LoadedData("d", [], [], 0, source_field="translation.en", target_field="translation.de")
    assert _default_prefix(TRANSLATION, cfg, data)[0] == "translate English to German: "
    assert _default_prefix(TASKS["summarization"], cfg, data) == (
        "summarize: ", "the checkpoint's task_specific_params['summarization']")
    data.source_field = "translation.de"       # de -> en: the checkpoint has no prefix for it
    assert _default_prefix(TRANSLATION, cfg, data) == ("", None)
