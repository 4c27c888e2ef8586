import numpy as np
import pytest

import deepreduce as dr
from deepreduce.codecs.base import IndexCodec
from deepreduce.registry import _REGISTRY, get_codec
from deepreduce.spec import format_spec, parse_spec


def test_parse_and_format_spec():
    assert parse_spec("qsgd:bits=4,bucket=256") == ("qsgd", [], {"bits": 4, "bucket": 256})
    assert parse_spec("topk:0.01") == ("topk", [0.01], {})
    assert parse_spec("x:flag=true,name=abc,f=1e-3") == ("x", [], {"flag": True, "name": "abc",
                                                                   "f": 0.001})
    assert format_spec("zstd", {"level": 9}) == "zstd:level=9"
    assert format_spec("bloom", {"fpr": 0.001}) == "bloom:fpr=0.001"
    with pytest.raises(ValueError):
        parse_spec("")
    with pytest.raises(ValueError, match="positional"):
        parse_spec("x:a=1,2")


@pytest.mark.parametrize("family", ["index", "value"])
def test_every_codec_config_round_trips(family):
    for codec_id, cls in dr.registered_codecs(family).items():
        codec = cls()
        config = codec.get_config()
        assert config["id"] == codec_id
        assert dr.get_codec(config, family=family) == codec
        assert dr.get_codec(codec.spec(), family=family) == codec
        assert cls.from_config(config) == codec


def test_get_codec_forms_and_errors():
    codec = dr.get_codec("zstd:level=9", family="value")
    assert codec.get_config() == {"id": "zstd", "level": 9}
    assert codec.spec() == "zstd:level=9"
    assert dr.get_codec(codec) is codec
    with pytest.raises(ValueError, match="both an index and a value"):
        dr.get_codec("zstd")
    with pytest.raises(ValueError, match="unknown index codec"):
        dr.get_codec("nope", family="index")
    with pytest.raises(ValueError, match="expected a index codec"):
        dr.get_codec(codec, family="index")
    with pytest.raises(ValueError, match="needs an 'id'"):
        dr.get_codec({"level": 3})


def test_register_custom_codec():
    class Mine(IndexCodec):
        codec_id = "mine-test"

        def __init__(self, width=3):
            self.width = width

    try:
        dr.register_codec(Mine)
        assert dr.get_codec("mine-test:width=5", family="index").width == 5
        with pytest.raises(ValueError, match="already registered"):
            dr.register_codec(type("Other", (IndexCodec,), {"codec_id": "mine-test"}))
    finally:
        _REGISTRY["index"].pop("mine-test", None)
    with pytest.raises(ValueError, match="codec_id"):
        dr.register_codec(type("Bad", (IndexCodec,), {"codec_id": "a b"}))


def test_decoding_uses_the_codec_registered_now():
    from deepreduce.codecs.index.varint import VarintIndices

    payload = dr.compress(np.array([0.0, 2.0, 0.0, 3.0]), index="varint", value="raw")
    dr.decompress(payload)  # its codecs are built and kept for the next payloads

    class Counting(VarintIndices):
        calls = 0

        def decode(self, data, n, nnz):
            Counting.calls += 1
            return super().decode(data, n, nnz)

    try:
        dr.register_codec(Counting, replace=True)
        np.testing.assert_array_equal(dr.decompress(payload).indices, [1, 3])
        assert Counting.calls == 1
    finally:
        dr.register_codec(VarintIndices, replace=True)
    dr.decompress(payload)
    assert Counting.calls == 1


def test_kept_spec_strings_follow_the_parameters():
    # a codec keeps its spec string while its parameters are the very objects it was
    # made from: a parameter set after construction gives the spec of the new value
    codec = get_codec("zstd:level=9", family="index")
    assert codec.spec() == codec.header_spec() == "zstd:level=9"
    codec.level = 5
    assert codec.spec() == codec.header_spec() == "zstd:level=5"
    codec.level = 3  # (the default)
    assert codec.spec() == "zstd"
    codec.level = True  # equal to 1, written otherwise: the spec follows the object
    assert codec.spec() == codec._format_spec(())
    auto = get_codec("auto:link_gbits=10", family="index")
    assert auto.spec() == "auto:link_gbits=10" and auto.header_spec() == "auto"
    auto.link_gbits = 1
    assert auto.spec() == "auto:link_gbits=1" and auto.header_spec() == "auto"



def test_the_registry_holds_the_built_in_codecs_in_order():
    # in the order the families' packages import their modules (issue 44 kept it when it
    # moved them; issue 51 removed their old paths)
    assert {family: list(dr.registered_codecs(family)) for family in ("index", "value")} == {
        "index": ["raw", "bitpack", "varint", "deflate", "zstd", "bitmap", "rle", "eliasfano",
                  "golomb", "blockpack", "bloom", "huffman", "runs", "auto", "chunked"],
        "value": ["raw", "fp32", "fp16", "bf16", "deflate", "zstd", "qsgd", "statq", "sign",
                  "polyfit", "dexp"]}
