"""Codec registry: the codecs by family and id, and building one from a spec.

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

from deepreduce.spec import format_spec, format_value, parse_spec, parse_value

FAMILIES = ("index", "value")
_REGISTRY: dict[str, dict[str, type]] = {family: {} for family in FAMILIES}

#: (the spec grammar lives in :mod:`deepreduce.spec`; its names stay importable from here)
__all__ = ["FAMILIES", "register_codec", "registered_codecs", "get_codec", "decoding_codec",
           "parse_spec", "parse_value", "format_spec", "format_value"]


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
