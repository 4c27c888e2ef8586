"""Every docstring example runs: the modules' Examples sections are executed as doctests."""

import doctest
import importlib
import pkgutil

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
