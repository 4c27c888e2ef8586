"""The flat layout's codec module paths keep working after the move by family (issue 44).

``deepreduce.codecs.golomb`` is ``deepreduce.codecs.index.golomb`` itself; the modules that
were split by family (``deflate``, ``zstd``, ``floats``) find each name in its new home;
and pickles that name a codec class by its old module still load.
"""

import importlib
import pickle

import numpy as np
import pytest

import deepreduce as dr
import deepreduce.codecs
from deepreduce.registry import registered_codecs

#: Each built-in codec class's module before the move (its ``__module__`` in old pickles).
OLD_MODULES = {
    ("index", "raw"): "raw", ("index", "bitpack"): "bitpack", ("index", "varint"): "varint",
    ("index", "deflate"): "deflate", ("index", "zstd"): "zstd", ("index", "bitmap"): "bitmap",
    ("index", "rle"): "rle", ("index", "eliasfano"): "eliasfano", ("index", "golomb"): "golomb",
    ("index", "blockpack"): "blockpack", ("index", "bloom"): "bloom",
    ("index", "huffman"): "huffman", ("index", "runs"): "runs", ("index", "auto"): "auto",
    ("index", "chunked"): "chunked",
    ("value", "raw"): "floats", ("value", "fp32"): "floats", ("value", "fp16"): "floats",
    ("value", "bf16"): "floats", ("value", "deflate"): "deflate", ("value", "zstd"): "zstd",
    ("value", "qsgd"): "qsgd", ("value", "statq"): "statq", ("value", "sign"): "sign",
    ("value", "polyfit"): "polyfit", ("value", "dexp"): "dexp",
}


def test_the_registry_holds_the_same_codecs_in_the_same_order():
    assert [(family, codec_id) for family in ("index", "value")
            for codec_id in registered_codecs(family)] == list(OLD_MODULES)


@pytest.mark.parametrize("old, homes", sorted(deepreduce.codecs.MOVED.items()))
def test_an_old_module_path_imports(old, homes):
    module = importlib.import_module(f"deepreduce.codecs.{old}")
    assert getattr(deepreduce.codecs, old) is module
    new = [importlib.import_module(f"deepreduce.codecs.{home}") for home in homes]
    if len(new) == 1:
        assert module is new[0]
    for home in new:  # every name of the new homes, through the old path
        for name in vars(home):
            if not name.startswith("__"):
                assert getattr(module, name) is getattr(home, name)
    with pytest.raises(AttributeError):
        module.no_such_name


def test_the_old_imports_of_the_docs_and_tests():
    from deepreduce.codecs import floats, golomb, qsgd
    from deepreduce.codecs.deflate import DeflateIndices, DeflateValues, deflate
    from deepreduce.codecs.floats import RawValues, SUPPORTED_DTYPES, check_values
    from deepreduce.codecs.zstd import ZstdIndices, ZstdValues, zstd_compress

    assert golomb.GolombIndices is dr.get_codec("golomb").__class__
    assert qsgd.__name__ == "deepreduce.codecs.values.qsgd" and floats.Float16Values
    assert (DeflateIndices.family, DeflateValues.family, ZstdIndices.family,
            ZstdValues.family) == ("index", "value", "index", "value")
    assert RawValues().encode(check_values(np.float32([1.5]))) == np.float32(1.5).tobytes()
    assert zstd_compress(b"", 3) and deflate(b"", 6) is not None and SUPPORTED_DTYPES


@pytest.mark.parametrize("family, codec_id", list(OLD_MODULES))
def test_a_pickle_naming_the_old_module_loads(family, codec_id):
    codec = dr.get_codec(codec_id, family=family)
    data = pickle.dumps(codec, protocol=2)  # GLOBAL: "module\nname\n", no length prefix
    new = type(codec).__module__.encode()
    old = f"deepreduce.codecs.{OLD_MODULES[family, codec_id]}".encode()
    assert data.count(b"c" + new + b"\n") == 1
    loaded = pickle.loads(data.replace(b"c" + new + b"\n", b"c" + old + b"\n"))
    assert type(loaded) is type(codec) and loaded == codec
