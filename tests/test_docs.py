"""Every docstring example runs: the modules' Examples sections are executed as doctests.
The README stays short and its links lead somewhere; the version is the same everywhere."""

import configparser
import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import deepreduce
import deepreduce.codecs


def modules():
    names, packages = ["deepreduce"], [deepreduce, deepreduce.codecs]
    while packages:  # (subpackages too: deepreduce.codecs.index, ...)
        package = packages.pop(0)
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            # the integrations need their frameworks: tested in test_horovod.py, test_torch.py
            if not info.name.startswith(("deepreduce.horovod", "deepreduce.torch")) \
                    and info.name not in names:
                names.append(info.name)
                if info.ispkg:
                    packages.append(importlib.import_module(info.name))
    return names


@pytest.mark.parametrize("name", modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"


ROOT = pathlib.Path(__file__).resolve().parent.parent


def checkout_file(name: str) -> pathlib.Path:
    path = ROOT / name
    if not path.exists():  # (the sdist's tests, run outside the checkout)
        pytest.skip(f"{name} is not beside tests/")
    return path


def slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading."""
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_the_readme_stays_short_and_its_links_lead_somewhere():
    readme = checkout_file("README.md").read_text()
    assert len(readme.splitlines()) <= 150  # the rest goes to docs/
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", readme):
        path = ROOT / target
        if not path.exists():
            broken.append(target)
        elif anchor and anchor not in {slug(line.lstrip("#")) for line in
                                       path.read_text().splitlines() if line.startswith("#")}:
            broken.append(f"{target}#{anchor}")
    assert broken == []


def test_the_version_is_the_same_everywhere():
    config = configparser.ConfigParser()
    config.read(checkout_file("setup.cfg"))
    version = config["metadata"]["version"]
    assert deepreduce.__version__ == version
    changelog = checkout_file("CHANGELOG.md").read_text()
    assert re.findall(r"^## (\S+)", changelog, re.M)[0] == version  # the newest section first
    assert f"dist/deepreduce-{version}.tar.gz" in checkout_file("README.md").read_text()
