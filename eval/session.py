"""One eval run: data in, the engine, the transformers reference, figures and checks out.

    data -> engine (warm-up, timed run) -> engine shut down -> transformers (timed, batched;
    mismatches re-run alone) -> metrics for both -> parity -> threshold checks

The engine is shut down before the reference loads, so on a GPU the two never share memory.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from enc2dec.engine.launch import build_llm_args, start_llm

from . import metrics as M
from .data import BadRow, Example, LoadedData, all_bad_error, load_examples
from .engine_runner import run_engine, warm_up
from .errors import EvalInputError
from .options import EvalOptions
from .parity import first_difference, parity_stats
from .report import NullProgress, build_report
from .tasks import THRESHOLD_FLAGS, TaskSpec, whisper_prompt


@dataclass
class Check:
    option: str
    figure: str
    value: float | None
    limit: float
    passed: bool


@dataclass
class RowOutput:
    example: Example
    encoder_ids: list[int]          # what the engine encoded (text); the reference encodes the same
    ours: list[int]
    ours_text: str
    finish_reason: str | None
    error: str | None = None
    hf: list[int] | None = None
    hf_text: str | None = None
    rechecked: bool = False


@dataclass
class Plan:
    """What both generators share, fixed once the engine has loaded the checkpoint."""

    max_tokens: int
    whisper_prompt: str | None                 # the engine's decoder prompt (Whisper), None for text
    whisper_kwargs: dict                       # the same for transformers: language, task
    prefix: str | None                         # text tasks
    prefix_from: str | None
    normalizer: M.Normalizer | None
    notes: list[str]
    hf_config: object
    generation_config: object
    tokenizer: object
    feature_extractor: object
    eos_ids: frozenset[int]
    device: object = None
    dtype: object = None
    attn_backend: str = ""


@dataclass
class EvalResult:
    report: dict
    exit_code: int
    checks: list[Check] = field(default_factory=list)
    rows: list[RowOutput] = field(default_factory=list)


def _default_prefix(spec: TaskSpec, hf_config, data: LoadedData) -> tuple[str, str | None]:
    """T5 checkpoints name their task prefixes in ``task_specific_params`` (``summarization``,
    ``translation_en_to_de``); the translation key comes from ``translation.XX`` field names."""
    params = getattr(hf_config, "task_specific_params", None) or {}
    key = spec.summary_prefix_key
    if spec.name == "translation":
        src, tgt = data.source_field.rsplit(".", 1)[-1], data.target_field.rsplit(".", 1)[-1]
        key = f"translation_{src}_to_{tgt}"
    prefix = (params.get(key) or {}).get("prefix") if key else None
    return (prefix, f"the checkpoint's task_specific_params[{key!r}]") if prefix else ("", None)


def _whisper_setup(opts: EvalOptions, spec: TaskSpec, core, tokenizer) -> tuple[str, list[int], dict]:
    """(engine prompt, decoder prefix ids, transformers generate kwargs)."""
    gen = core.processor.gen
    multilingual = getattr(gen, "is_multilingual", None)
    if multilingual is None:
        multilingual = core.hf_config.vocab_size >= 51865
    lang = opts.language
    if not multilingual:
        if spec.whisper_task == "translate" or lang not in (None, "en"):
            raise EvalInputError(f"{opts.model} is an English-only Whisper checkpoint: it can only transcribe "
                                 "English (drop --language, or use a multilingual checkpoint)")
        return "", list(core.processor.whisper_default_prefix), {}
    lang = lang or "en"
    if tokenizer is None or tokenizer.convert_tokens_to_ids(f"<|{lang}|>") in (None, tokenizer.unk_token_id):
        raise EvalInputError(f"--language {lang!r}: <|{lang}|> is not a token of this checkpoint; use a Whisper "
                             "language code such as en, de, fr")
    prompt = whisper_prompt(spec, lang)
    return prompt, tokenizer.encode(prompt, add_special_tokens=False), {"language": lang,
                                                                        "task": spec.whisper_task}


def _max_tokens(opts: EvalOptions, spec: TaskSpec, hf_config, prefix_len: int, notes: list[str]) -> int:
    wanted = opts.max_tokens or spec.max_tokens
    table = hf_config.max_target_positions if hf_config.model_type == "whisper" else (
        hf_config.max_position_embeddings if hf_config.model_type in ("bart", "mbart") else None)
    if table is not None and wanted > table - prefix_len:
        notes.append(f"max_tokens capped from {wanted} to {table - prefix_len} by the decoder's "
                     f"{table}-position table")
        return table - prefix_len
    return wanted


def _checks(opts: EvalOptions, ours: dict, parity: dict | None) -> list[Check]:
    checks = []
    for name, limit in opts.thresholds.items():
        figure = opts.spec.thresholds[name]
        value = parity["exact_match"] if figure == "parity" else ours.get(figure)
        passed = value is not None and (value <= limit if name.startswith("max") else value >= limit)
        checks.append(Check(THRESHOLD_FLAGS[name], figure, value, limit, passed))
    return checks


def engine_args(opts: EvalOptions):
    """The engine's options: the YAML (if any) and the command line, which wins; where neither
    sets ``max_batch_size`` it is eval's ``--batch-size``, so both sides batch alike."""
    try:
        return build_llm_args(opts.model, opts.config, defaults={"max_batch_size": opts.batch_size},
                              **opts.engine_overrides)
    except ValueError as e:
        raise EvalInputError(f"--config {opts.config}: {e}" if opts.config else str(e)) from None


def run_eval(opts: EvalOptions, progress=None) -> EvalResult:
    progress = progress or NullProgress()
    opts.validate()
    spec = opts.spec
    M.check_available(spec.metrics)
    args = engine_args(opts)
    if opts.num_beams > 1:
        # Reserve the beams, and rows for them: transformers runs batch_size x num_beams rows too.
        args = dataclasses.replace(args, max_beam_width=max(args.max_beam_width, opts.num_beams),
                                   max_batch_size=args.max_batch_size * opts.num_beams)
    if opts.reference == "hf" and args.load_format == "dummy":
        raise EvalInputError("--reference hf needs the checkpoint's weights, and the config asks for "
                             "load_format: dummy; use --reference none")
    data = load_examples(opts.data, spec)          # bad data fails before any model loads
    bad: list[BadRow] = list(data.bad_rows)
    if not data.examples:
        raise all_bad_error(data, bad)
    plan, rows, engine_wall_s = _engine_side(opts, args, data, bad, progress)
    hf_wall_s = None
    if opts.reference == "hf":            # after the engine has shut down: they never share a GPU
        hf_wall_s = _reference_side(opts, args, plan, rows, progress)

    refs = [r.example.reference for r in rows]
    ours, metric_notes = M.score(spec.metrics, [r.ours_text for r in rows], refs, plan.normalizer)
    hf_metrics, parity = None, None
    if opts.reference == "hf":
        hf_metrics, _ = M.score(spec.metrics, [r.hf_text for r in rows], refs, plan.normalizer)
        parity = parity_stats([r.ours for r in rows], [r.hf for r in rows], [r.ours_text for r in rows],
                              [r.hf_text for r in rows]).as_dict()
        parity["num_rechecked_alone"] = sum(r.rechecked for r in rows)
    checks = _checks(opts, ours, parity)
    failures = [r for r in rows if r.error]
    exit_code = 1 if failures or not all(c.passed for c in checks) else 0
    report = build_report(
        opts=opts, args=args, data=data, bad=bad, rows=rows, device=plan.device, dtype=plan.dtype,
        attn_backend=plan.attn_backend,
        decoding={"greedy": opts.num_beams == 1, "num_beams": opts.num_beams, "max_tokens": plan.max_tokens, "whisper_prompt": plan.whisper_prompt,
                  "prefix": plan.prefix, "prefix_from": plan.prefix_from, "notes": plan.notes},
        normalizer=plan.normalizer.name if plan.normalizer else None, ours=ours, hf=hf_metrics,
        metric_notes=metric_notes, parity=parity, engine_wall_s=engine_wall_s, hf_wall_s=hf_wall_s,
        checks=checks, failures=failures, exit_code=exit_code)
    return EvalResult(report, exit_code, checks, rows)


def _plan(opts: EvalOptions, args, core, tokenizer, data: LoadedData, bad: list[BadRow]) -> tuple[Plan, list]:
    """Decoding settings and the examples that remain (prefixed, or with usable references)."""
    spec, hf_config = opts.spec, core.hf_config
    if (hf_config.model_type == "whisper") != spec.is_audio:
        kind = "a Whisper checkpoint" if spec.is_audio else "a text checkpoint (T5, BART, mBART)"
        raise EvalInputError(f"--task {spec.name} needs {kind}; {opts.model} is {hf_config.model_type}")
    plan = Plan(0, None, {}, None, None, None, [], hf_config, core.processor.gen, tokenizer,
                core.processor.feature_extractor, frozenset(core.processor.eos_token_ids))
    examples = data.examples
    if spec.is_audio:
        plan.whisper_prompt, prefix_ids, plan.whisper_kwargs = _whisper_setup(opts, spec, core, tokenizer)
        if "wer" in spec.metrics:
            plan.normalizer = M.whisper_normalizer(args.model if os.path.isdir(args.model) else None,
                                                   tokenizer, opts.language)
            empty = {ex.row for ex in examples if not plan.normalizer(ex.reference).strip()}
            bad += [BadRow(row, "empty text", "the reference is empty after normalization") for row in empty]
            examples = [ex for ex in examples if ex.row not in empty]
    else:
        prefix_ids = [core.processor.decoder_start_token_id]
        plan.prefix, plan.prefix_from = opts.prefix, "--prefix"
        if opts.prefix is None:
            plan.prefix, plan.prefix_from = _default_prefix(spec, hf_config, data)
        for ex in examples:
            ex.source = plan.prefix + ex.source
        plan.prefix_from = plan.prefix_from if plan.prefix else None
    plan.max_tokens = _max_tokens(opts, spec, hf_config, len(prefix_ids), plan.notes)
    return plan, examples


def _engine_side(opts: EvalOptions, args, data: LoadedData, bad: list[BadRow], progress):
    from enc2dec.engine import SamplingParams

    try:
        llm = start_llm(args)
    except ValueError as e:
        raise EvalInputError(str(e)) from None
    try:
        core = llm.engine
        plan, examples = _plan(opts, args, core, llm.tokenizer, data, bad)
        if not examples:
            raise all_bad_error(data, bad)
        params = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0, use_beam_search=opts.num_beams > 1,
                                best_of=opts.num_beams, n=1)
        warm_up(llm, examples, params, plan.whisper_prompt, opts.warmup)
        run = run_engine(llm, examples, params, plan.whisper_prompt, progress,
                         max_in_flight=4 * args.max_batch_size)
        bad += run.rejected
        if not run.outputs:
            raise all_bad_error(data, bad)
        rows = []
        for ex in examples:
            if ex.row not in run.outputs:
                continue
            out = run.outputs[ex.row]
            comp = out.outputs[0]
            rows.append(RowOutput(ex, list(out.prompt_token_ids), list(comp.token_ids), comp.text,
                                  comp.finish_reason,
                                  out.error or ("aborted" if comp.finish_reason == "abort" else None)))
        plan.device, plan.dtype = core.device, core.dtype
        plan.attn_backend = getattr(getattr(core.runner, "backend", None), "name", args.attn_backend)
    finally:
        llm.shutdown()
    return plan, rows, run.wall_s


def _reference_side(opts: EvalOptions, args, plan: Plan, rows: list[RowOutput], progress) -> float:
    """transformers on the same inputs: one timed batched pass, then every row that differs
    from the engine's output and ran in a batch is run again alone (``rechecked``)."""
    from enc2dec.engine.inputs.model_source import resolve_model

    from .hf_reference import HfReference

    path = args.model if os.path.isdir(args.model) else resolve_model(args.model, None, args.load_format).path
    ref = HfReference(path, plan.device, plan.dtype, plan.hf_config, plan.generation_config, plan.tokenizer,
                      plan.feature_extractor, plan.max_tokens, plan.whisper_kwargs, plan.eos_ids, opts.num_beams)
    plan.notes += ref.notes
    try:
        items = {r.example.row: (r.example.source if opts.spec.is_audio else r.encoder_ids) for r in rows}
        warm = list(items)[:opts.warmup]
        if warm:
            ref.run({row: items[row] for row in warm}, opts.batch_size, NullProgress())
        results, wall_s = ref.run(items, opts.batch_size, progress)
        for r in rows:
            r.hf = results[r.example.row]
            if opts.batch_size > 1 and first_difference(r.ours, r.hf) is not None:
                r.hf, r.rechecked = ref.generate_alone(items[r.example.row]), True
            r.hf_text = ref.decode(r.hf)
    finally:
        ref.close()
    return wall_s
