"""benchmarks.hierarchical's report, written again from the committed record (the run
itself needs root and network namespaces: ``python -m benchmarks.hierarchical``)."""

import importlib
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "hierarchical.json"


@pytest.mark.skipif(not RECORD.is_file(), reason="the benchmarks' results live in the "
                    "checkout (not in an installed wheel)")
def test_the_report_is_written_again_from_its_record(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    benchmark = importlib.import_module("benchmarks.hierarchical")
    shutil.copy(RECORD, tmp_path / "hierarchical.json")
    out = tmp_path / "hierarchical.md"
    assert benchmark.main(["--from-json", "--out", str(out)]) == 0
    text = out.read_text()
    record = json.loads(RECORD.read_text())
    for run in record["runs"]:
        by = {r["scheme"]: r for r in run["results"]}
        ratio = (by[benchmark.HIERARCHICAL]["wire_bytes_per_step"]
                 / by[benchmark.FLAT]["wire_bytes_per_step"])
        assert f"## {run['rate']} " in text
        assert f"Hierarchical / flat bytes across the veth: {ratio:.3f}" in text
    assert text.count("Where the time goes:") == len(record["runs"])
    assert text == (ROOT / "benchmarks" / "results" / "hierarchical.md").read_text()
