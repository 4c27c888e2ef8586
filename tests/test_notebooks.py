"""The notebooks run top to bottom, and their committed copies carry their outputs.

Each notebook is executed in a fresh kernel of this interpreter (nbclient,
``kernel_name="python3"``), from the ``notebooks/`` folder, without writing
back: the committed copies are refreshed by hand. A notebook whose codecs or
modules are not available yet is skipped with a message naming what is missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

import deepreduce as dr  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

#: What each notebook needs beyond the core: ("module", name) or (family, codec id).
REQUIRES = {
    "codec_comparison.ipynb": (),
    "bloom_policies.ipynb": (("index", "bloom"),),
    "curve_fitting.ipynb": (("value", "polyfit"), ("value", "dexp")),
    "collectives.ipynb": (("module", "deepreduce.collectives.cost"),),
}
CELL_TIMEOUT = 600


def missing_requirement(notebook: str) -> str | None:
    """A sentence naming the first missing requirement of ``notebook``, or None."""
    for kind, name in REQUIRES[notebook]:
        if kind == "module":
            try:
                importlib.import_module(name)
            except ImportError as exc:
                return f"{notebook} needs module {name}, not importable yet ({exc})"
        elif name not in dr.registered_codecs(kind):
            return (f"{notebook} needs the {kind} codec {name!r} (module "
                    f"deepreduce.codecs.{name} or the module registering it), not "
                    "registered yet")
    return None


def test_every_notebook_is_listed():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} <= set(REQUIRES)


@pytest.mark.parametrize("notebook", sorted(REQUIRES))
def test_committed_copy_shows_outputs(notebook):
    path = NOTEBOOKS / notebook
    if not path.exists():
        pytest.skip(f"{notebook} is not written yet")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{notebook} has no code"
    assert all(c.execution_count for c in code), f"{notebook}: committed without running"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{notebook}: committed with an error: {errors[0].ename}"
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), \
        f"{notebook}: no plot in the committed copy"


@pytest.mark.parametrize("notebook", sorted(REQUIRES))
def test_notebook_runs(notebook):
    path = NOTEBOOKS / notebook
    if not path.exists():
        pytest.skip(f"{notebook} is not written yet")
    reason = missing_requirement(notebook)
    if reason:
        pytest.skip(reason)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
