"""``enc2dec eval``: accuracy on a dataset, and agreement with transformers' own outputs.

    from enc2dec.eval.options import EvalOptions
    from enc2dec.eval.session import run_eval

Modules: ``tasks`` (what each task measures), ``data`` and ``audio`` (rows in), ``metrics``
(BLEU, chrF, ROUGE, WER, CER), ``parity`` (token-id agreement), ``engine_runner`` and
``hf_reference`` (the two generators), ``session`` (one run), ``report`` (table and JSON).
"""
