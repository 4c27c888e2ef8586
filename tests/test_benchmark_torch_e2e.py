"""benchmarks.torch_e2e's report, written again from the committed record (the run
itself needs root and network namespaces: ``python -m benchmarks.torch_e2e``)."""

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "torch_e2e.json"


@pytest.mark.skipif(not RECORD.is_file(), reason="the benchmarks' results live in the "
                    "checkout (not in an installed wheel)")
def test_the_report_is_written_again_from_its_record(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT))
    benchmark = importlib.import_module("benchmarks.torch_e2e")
    out = tmp_path / "torch_e2e.md"
    assert benchmark.main(["--from-json", str(RECORD), "--out", str(out)]) == 0
    text = out.read_text()
    assert text == (ROOT / "benchmarks" / "results" / "torch_e2e.md").read_text()
    for run in json.loads(RECORD.read_text())["runs"]:
        by = {r["scheme"]: r for r in run["results"]}
        if run["rate"] != "1gbit" or benchmark.NOTHING not in by:
            continue
        # what 2x PowerSGD rank 1 leaves a hook: half its step, less DDP's own step with
        # a hook that does nothing, less the wire time of deepreduce's bytes
        half = next(r for r in run["results"] if "rank 1" in r["scheme"])["step_ms_median"] / 2
        wire = by[benchmark.DEEPREDUCE]["wire_bytes_per_step"] * 8e3 / (
            run["measured_gbit"] * 1e9)
        budget = half - by[benchmark.NOTHING]["step_ms_median"] - wire
        assert f"leaves any hook {budget:.1f} ms of work a step" in text
