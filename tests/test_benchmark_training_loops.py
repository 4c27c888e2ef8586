"""benchmarks.training_loops on two cheap scenarios: each cell runs on two fresh gloo
ranks, is judged from what they measured, and DDP's own allreduce works in both."""

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["no_sync", "two_models"]
SCHEMES = ["allreduce", "deepreduce"]


@pytest.fixture
def benchmark(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.training_loops")


def test_cells_are_run_and_judged(benchmark):
    cells = benchmark.run_cells(SCENARIOS, SCHEMES, log=lambda *a, **k: None)
    assert [(c["scenario"], c["scheme"]) for c in cells] == [
        (s, k) for s in SCENARIOS for k in SCHEMES]
    rows = benchmark.rows(cells, SCHEMES)
    assert [row[0] for row in rows] == [benchmark.SCENARIOS[s].label for s in SCENARIOS]
    for row, scenario in zip(rows, SCENARIOS):
        allreduce, deepreduce = row[1:]
        assert allreduce == "works", (scenario, [c["detail"] for c in cells])
        assert deepreduce.startswith(("works", "fails", "hangs"))
    for cell in cells:
        if cell["scheme"] != "allreduce":
            continue
        assert not cell["timed_out"]
        for rank in (0, 1):  # measured, not assumed: the loss fell and the ranks agree
            found = cell["ranks"][rank]
            assert found["ok"], found
            assert benchmark.trains(found["losses"], found.get("window", benchmark.POOL))
            assert found["params"] == cell["ranks"][1 - rank]["params"]


def test_a_verdict_follows_the_measurement(benchmark):
    assert sum(p.numel() for p in benchmark.net().parameters()) == benchmark.PARAMETERS
    found = {"ok": True, "losses": [2.8] * 8, "params": "a", "params_finite": True,
             "compressed": True, "nonfinite_steps": []}
    cell = {"scenario": "static_graph", "scheme": "deepreduce", "timed_out": False,
            "timeout_s": 1, "exitcodes": [0, 0], "log_lines": {0: [], 1: []},
            "ranks": {0: dict(found, rank=0), 1: dict(found, rank=1, params="b")}}
    verdict, detail = benchmark.judge(cell)
    assert verdict.startswith("fails:") and "ranks' parameters differ" in verdict
    assert "does not train" in verdict
    cell["timed_out"], cell["ranks"][1] = True, None
    assert benchmark.judge(cell)[0].startswith("hangs/times out")


def test_the_report_and_record_are_written(benchmark, tmp_path):
    out = tmp_path / "training_loops.md"
    assert benchmark.main(["--only", "no_sync", "--schemes", "allreduce",
                           "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 4. no_sync accumulation | works |" in text
    assert "python -m benchmarks.training_loops --only no_sync" in text
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["model_parameters"] == 336_912
    assert [c["verdict"] for c in record["cells"]] == ["works"]
