"""The paths 0.2.0 retired are gone, and CHANGELOG.md tells the truth about them (issue 51).

Every module that only re-exported another's names, every alias module of the codecs' flat
layout and the exchange's old module name fail to import; each name CHANGELOG.md lists
lives where it says; and a pickle naming an old path fails to load, as it says.
"""

import importlib
import pathlib
import pickle
import re

import pytest

import deepreduce as dr
import deepreduce.codecs

CHANGELOG = pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md"

#: The module paths 0.2.0 removed (CHANGELOG.md lists each with its home).
RETIRED = [
    "deepreduce.memory", "deepreduce.selection", "deepreduce.stats",
    "deepreduce.collectives.base", "deepreduce.collectives.hierarchical",
    "deepreduce.exchange.allgather",
    *(f"deepreduce.codecs.{old}" for old in (
        "raw", "bitpack", "varint", "bitmap", "rle", "eliasfano", "golomb", "blockpack",
        "bloom", "huffman", "runs", "auto", "chunked", "_entropy", "qsgd", "statq", "sign",
        "polyfit", "dexp", "floats", "deflate", "zstd", "_compressed")),
]


@pytest.mark.parametrize("module", RETIRED)
def test_a_retired_path_does_not_import(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)
    parent, _, name = module.rpartition(".")
    assert not hasattr(importlib.import_module(parent), name)


def test_the_codecs_keep_no_table_of_moved_modules():
    assert not hasattr(deepreduce.codecs, "MOVED")


def test_a_pickle_naming_a_flat_codec_path_does_not_load():
    codec = dr.get_codec("golomb")
    data = pickle.dumps(codec, protocol=2)  # GLOBAL: "module\nname\n", no length prefix
    new = b"cdeepreduce.codecs.index.golomb\n"
    assert data.count(new) == 1
    assert pickle.loads(data) == codec
    with pytest.raises(ModuleNotFoundError, match="deepreduce.codecs.golomb"):
        pickle.loads(data.replace(new, b"cdeepreduce.codecs.golomb\n"))


def changelog_rows(title: str) -> list:
    """The rows of the first table under the heading ``title`` of CHANGELOG.md's 0.2.0
    section, each a list of its cells' backticked names."""
    if not CHANGELOG.exists():  # (the sdist's tests, run outside the checkout)
        pytest.skip("CHANGELOG.md is not beside tests/")
    section = CHANGELOG.read_text().split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]
    return [[re.findall(r"`([^`]+)`", cell) for cell in row] for row in rows]


def test_every_retired_module_is_in_the_changelog():
    listed = [cells[0][0] for title in ("Removed modules, and where their names live",
                                        "Removed alias modules of the codecs' flat layout "
                                        "(`deepreduce.codecs.MOVED`)")
              for cells in changelog_rows(title) if cells[0]]
    listed += [changelog_rows("Renamed")[0][0][0]]
    assert sorted(listed) == sorted(RETIRED)


def test_the_names_of_the_removed_modules_live_where_the_changelog_says():
    rows = changelog_rows("Removed modules, and where their names live")
    assert len(rows) == 8
    for _, names, homes in rows:
        home = importlib.import_module(homes[0])
        assert names and [name for name in names if not hasattr(home, name)] == []


def test_the_flat_codec_modules_live_where_the_changelog_says():
    rows = changelog_rows("Removed alias modules of the codecs' flat layout "
                          "(`deepreduce.codecs.MOVED`)")
    assert len(rows) == 23
    for _, now in rows:
        homes = [name for name in now if name.startswith("deepreduce.")]
        named = [name for name in now if not name.startswith("deepreduce.")]
        modules = [importlib.import_module(home) for home in homes]
        # a split module's names, each in the home it follows
        missing = [name for name in named if not any(hasattr(m, name) for m in modules)]
        assert modules and missing == []


def test_the_renamed_exchange_is_where_the_changelog_says():
    from deepreduce.exchange.gathering import GatheringExchange

    (old,), (new, *_) = changelog_rows("Renamed")[1]
    assert new == "deepreduce.exchange.gathering.GatheringExchange"
    assert old == "deepreduce.exchange.allgather.AllgatherExchange"
    assert GatheringExchange.__module__ == "deepreduce.exchange.gathering"
    assert dr.ExchangeConfig().communicator == "allgather"  # the setting keeps its name
