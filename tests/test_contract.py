"""Every registered codec, in its default and its layout-changing configurations,
passes the codec contract of deepreduce.testing."""

import pytest

import deepreduce as dr
from deepreduce.testing import check_codec

#: Relative L2 error allowed on Gaussian values, per lossy value codec (documented
#: in each codec's docstring; these are upper bounds with a margin).
ERROR_BOUNDS = {"fp16": 1e-3, "bf16": 1e-2, "fp32": 1e-6, "qsgd": 0.3, "sign": 1.0,
                "polyfit": 0.5, "dexp": 1.0, "statq": 0.7,
                # one level: unbiased, but the variance of a coin flip per value
                "qsgd:bits=2": 1.6, "qsgd:bits=8,norm=l2": 0.3}
#: Configurations that change a stream's layout, beyond the defaults.
VARIANTS = ["qsgd:bits=2", "qsgd:bits=8,norm=l2", "bloom:policy=leftmost",
            "bloom:policy=random", "bloom:policy=conflict_sets", "bloom:policy=naive",
            "huffman:block=8", "golomb:mode=rice", "auto:link_gbits=10", "chunked:chunk=16",
            "statq:bits=8"]


def codecs():
    specs = [(family, codec_id) for family in ("index", "value")
             for codec_id in sorted(dr.registered_codecs(family))]
    index_ids = ("bloom", "huffman", "golomb", "auto", "chunked")
    specs += [("index" if spec.startswith(index_ids) else "value", spec) for spec in VARIANTS]
    return [pytest.param(family, spec, id=f"{family}-{spec}") for family, spec in specs]


@pytest.mark.parametrize("family, spec", codecs())
def test_codec_keeps_the_contract(family, spec):
    codec = dr.get_codec(spec, family=family)
    bound = ERROR_BOUNDS.get(spec, ERROR_BOUNDS.get(codec.codec_id))
    check_codec(codec, bound if family == "value" else None)


def test_every_registered_codec_is_covered():
    covered = {(family, spec.split(":")[0]) for family, spec in
               (param.values for param in codecs())}
    registered = {(family, codec_id) for family in ("index", "value")
                  for codec_id in dr.registered_codecs(family)}
    assert registered <= covered
