"""How every command turns its options into an engine: one ``LlmArgs`` builder, one start.

``bench``, ``eval``, ``transcribe`` and ``serve`` all take a YAML config (the ``LLM`` option
names, TensorRT-LLM's ``enc-dec-config.yaml`` shape) plus command-line options that win
over it. Both functions raise ``ValueError`` with the message a user should see; each
command maps that to its own usage error (exit 2). Importing this module loads no torch:
the CLI builds the args before the engine is imported.
"""
from __future__ import annotations

import dataclasses

from enc2dec.engine.config import LlmArgs

# The commands' share of the KV budget for cross-attention when the config leaves it unset
# (``LLM`` itself requires it): half is the engine's advice for a start.
DEFAULT_CROSS_KV_FRACTION = 0.5
# Command-line options that are fields of ``kv_cache_config``, not of ``LlmArgs``: option -> field.
KV_KEYS = {"cross_kv_cache_fraction": "cross_kv_cache_fraction",
           "free_gpu_memory_fraction": "free_gpu_memory_fraction", "kv_cache_dtype": "dtype"}


def _config_sets(config_path: str | None, key: str) -> bool:
    if not config_path:
        return False
    import yaml

    try:
        with open(config_path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False         # LlmArgs.from_yaml reports the problem with the file
    return isinstance(data, dict) and key in data


def build_llm_args(model: str, config_path: str | None = None, *, defaults: dict | None = None,
                   **overrides) -> LlmArgs:
    """``LlmArgs`` from the YAML at ``config_path`` (if any) and ``overrides`` (None: not given),
    which win. The ``KV_KEYS`` go into ``kv_cache_config``. ``defaults`` are a command's own
    values for top-level options that neither the config nor an override sets (eval's batch
    size); a missing ``cross_kv_cache_fraction`` becomes ``DEFAULT_CROSS_KV_FRACTION``."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    kv_overrides = {field: overrides.pop(k) for k, field in KV_KEYS.items() if k in overrides}
    for key, value in (defaults or {}).items():
        if key not in overrides and not _config_sets(config_path, key):
            overrides[key] = value
    try:
        args = (LlmArgs.from_yaml(config_path, model=model, **overrides) if config_path
                else LlmArgs.from_dict({}, model=model, **overrides))
        kv = dataclasses.replace(args.kv_cache_config, **kv_overrides)
        if kv.cross_kv_cache_fraction is None:
            kv = dataclasses.replace(kv, cross_kv_cache_fraction=DEFAULT_CROSS_KV_FRACTION)
        return dataclasses.replace(args, kv_cache_config=kv)
    except TypeError as e:      # a YAML value of the wrong kind that a comparison tripped over
        raise ValueError(str(e)) from None


def start_llm(args: LlmArgs):
    """The engine for ``args``; a model, option or size the engine rejects is a ``ValueError``
    that names the model."""
    from enc2dec.engine import LLM

    try:
        return LLM.from_args(args)
    except ValueError as e:
        raise ValueError(f"cannot start the engine for {args.model}: {e}") from None
