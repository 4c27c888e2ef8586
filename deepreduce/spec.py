"""The ``"id:key=value,..."`` spec grammar of codecs and sparsifiers.

A spec names a codec or a sparsifier and the constructor arguments that differ
from the defaults::

    varint
    zstd:level=9
    topk:0.01

Below the codec registry (:mod:`deepreduce.registry`) and the sparsifiers
(:mod:`deepreduce.sparsifiers`), which both read it.
"""

from __future__ import annotations

import math


def parse_value(text: str):
    """Turn one spec value into int, float, bool or str (in that order of preference)."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, list, dict]:
    """Split ``"name:a,b=2"`` into ``("name", [a], {"b": 2})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a spec must be a non-empty string like 'zstd:level=9', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    args, kwargs = [], {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if eq:
            kwargs[key.strip()] = parse_value(value.strip())
        elif kwargs:
            raise ValueError(f"positional value {item!r} after keyword values in spec {spec!r}")
        else:
            args.append(parse_value(item))
    return name.strip().lower(), args, kwargs


def format_value(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"spec values must be finite, got {value!r}")
        return repr(value)
    if isinstance(value, (int, str)):
        text = str(value)
        if isinstance(value, str) and (not text or any(c in text for c in ",=:")):
            raise ValueError(f"string spec values may not be empty or contain ',', '=' or ':': {text!r}")
        return text
    raise ValueError(f"spec values must be int, float, bool, None or str, got {type(value).__name__}")


def format_spec(codec_id: str, params: dict) -> str:
    """Inverse of :func:`parse_spec` for keyword parameters."""
    if not params:
        return codec_id
    return codec_id + ":" + ",".join(f"{k}={format_value(v)}" for k, v in params.items())
