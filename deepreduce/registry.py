"""Codec registry and the ``"id:key=value,..."`` spec grammar.

Index codecs and value codecs live in separate namespaces, so ``"zstd"`` can
name both a gap-coding index codec and a byte-shuffling value codec. A spec
names a codec and the constructor arguments that differ from the defaults::

    varint
    zstd:level=9
    qsgd:bits=4,bucket=256

The same grammar is used on the command line, in Python calls and inside
payload headers, so what ``deepreduce inspect`` prints can be pasted back.
"""

from __future__ import annotations

import functools
import math

FAMILIES = ("index", "value")
_REGISTRY: dict[str, dict[str, type]] = {family: {} for family in FAMILIES}


def register_codec(cls, replace: bool = False):
    """Register a codec class under ``cls.family`` and ``cls.codec_id``.

    Usable as a class decorator. Registering a second class under a taken name
    raises ``ValueError`` unless ``replace=True``.
    """
    family, codec_id = getattr(cls, "family", ""), getattr(cls, "codec_id", "")
    if family not in FAMILIES:
        raise ValueError(f"{cls.__name__}.family must be one of {FAMILIES}, got {family!r}")
    if not codec_id or not all(c.isalnum() or c in "_-" for c in codec_id):
        raise ValueError(f"{cls.__name__}.codec_id must be a non-empty name of letters, "
                         f"digits, '_' or '-', got {codec_id!r}")
    table = _REGISTRY[family]
    if codec_id in table and table[codec_id] is not cls and not replace:
        raise ValueError(f"{family} codec {codec_id!r} is already registered "
                         f"({table[codec_id].__name__}); pass replace=True to override")
    table[codec_id] = cls
    decoding_codec.cache_clear()
    return cls


def registered_codecs(family: str) -> dict[str, type]:
    """A copy of the ``{codec_id: class}`` table of one family."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return dict(_REGISTRY[family])


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


def _lookup(codec_id: str, family: str | None):
    families = [family] if family else [f for f in FAMILIES if codec_id in _REGISTRY[f]]
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if len(families) > 1:
        raise ValueError(f"{codec_id!r} names both an index and a value codec; "
                         f"pass family='index' or family='value'")
    if not families or codec_id not in _REGISTRY[families[0]]:
        where = f"{family} " if family else ""
        known = ", ".join(sorted(_REGISTRY[family] if family else
                                 set().union(*_REGISTRY.values())))
        raise ValueError(f"unknown {where}codec {codec_id!r}; known: {known}")
    return _REGISTRY[families[0]][codec_id]


def get_codec(spec, family: str | None = None):
    """Return a codec instance from an instance, a config dict or a spec string.

    Parameters
    ----------
    spec : Codec, dict or str
        ``ZstdValues(level=9)``, ``{"id": "zstd", "level": 9}`` or ``"zstd:level=9"``.
    family : {"index", "value"}, optional
        Needed only when the id is registered in both families.

    Examples
    --------
    >>> import deepreduce as dr
    >>> dr.get_codec("zstd:level=9", family="value").get_config()
    {'id': 'zstd', 'level': 9}
    >>> dr.get_codec({"id": "varint"})
    VarintIndices()
    """
    from deepreduce.codecs.base import Codec

    if isinstance(spec, Codec):
        if family is not None and spec.family != family:
            raise ValueError(f"{spec!r} is a {spec.family} codec, expected a {family} codec")
        return spec
    if isinstance(spec, dict):
        config = dict(spec)
        if "id" not in config:
            raise ValueError(f"codec config needs an 'id' key, got {spec!r}")
        cls = _lookup(str(config["id"]).lower(), family)
        return cls.from_config({**config, "id": cls.codec_id})
    name, args, kwargs = parse_spec(spec)
    cls = _lookup(name, family)
    try:
        return cls(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"bad parameters in codec spec {spec!r}: {exc}") from None


@functools.lru_cache(maxsize=256)
def decoding_codec(spec: str, family: str):
    """``get_codec(spec, family)``, built once per spec: a payload names its codecs in
    its header, and building them again for every payload of a many-tensor step costs
    more than decoding a small one. Decoding leaves a codec unchanged, so one instance
    serves every payload (and thread); registering a codec empties the cache."""
    return get_codec(spec, family)
