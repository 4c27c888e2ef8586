"""Running a test with one of deepreduce's optional C extensions and with its numpy fallback.

Each extension is a module attribute (``bloom._bloomscan``, ``_entropy._entropyc``,
``sparsifiers._topkscan``) that is None where it was not built; setting it to
None makes the code take the numpy path.
"""

from unittest import mock

import pytest


def fixture(module, attribute: str, name: str):
    """A fixture ``name`` whose tests run with ``module.attribute``, then without it
    (the compiled run is skipped where the extension is not built)."""

    @pytest.fixture(params=["compiled", "numpy"], name=name)
    def implementation(request, monkeypatch):
        if request.param == "numpy":
            monkeypatch.setattr(module, attribute, None)
        elif getattr(module, attribute) is None:
            pytest.skip(f"{module.__name__}.{attribute} is not built")
        return request.param

    return implementation


def both(module, attribute: str, function, *args) -> list:
    """``[function(*args)`` as installed, ``function(*args)`` with the numpy fallback``]``."""
    installed = function(*args)
    with mock.patch.object(module, attribute, None):
        return [installed, function(*args)]
