"""benchmarks.outer at a tiny size: the bytes and scale parts (seconds), and the time part
across two network namespaces where this machine allows it (root, ``ip`` and ``tc``)."""

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not (ROOT / "benchmarks" / "outer.py").is_file(),
                                reason="the benchmarks live in the checkout (not in an "
                                "installed wheel)")


@pytest.fixture
def outer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.outer")


def run(outer, tmp_path, *argv):
    out = tmp_path / "outer.md"
    assert outer.main([*argv, "--quick", "--size", "128", "--out", str(out),
                       "--cache", str(tmp_path / "cache")]) == 0
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


def test_bytes_and_scale_at_a_tiny_size(outer, tmp_path):
    text, record = run(outer, tmp_path, "--parts", "bytes,scale")
    assert "## Bytes on SparseLoCo's settings" in text and "## Scale on paper" in text
    assert "## Time" not in text and "--parts bytes,scale" in text
    labels = [entry["label"] for entry in record["bytes"]["sets"]]
    assert labels[0] == "Gaussian 128 x 128" and labels[2].startswith("pseudo-gradients")
    for entry in record["bytes"]["sets"]:
        assert text.count(f"### {entry['label']}") == 1
        for k, m in entry["by_k"].items():
            assert m["kept"] == m["elements"] // 4096 * int(k)
            assert m["pack12"] == 12 and 20 < m["pack20"] < 22
            # chunked: within a few bytes per tensor of the (uniform choice's) bound, or auto's
            # stream and its tag where that is shorter (pseudo-gradients cluster)
            per_tensor_byte = 8 * m["tensors"] / m["kept"]
            assert m["chunked"] <= min(m["bound"] + 8 * per_tensor_byte,
                                       m["auto"] + per_tensor_byte)
            assert m["rice_bitmap"] > m["bound"]
            assert m["entropy_bound"] == pytest.approx(m["bound"] + m["statq_entropy"])
            assert m["payload_chunked"] > m["chunked"] + m["statq"]  # and a header
            assert set(m["targets"]) == {"index_within_1pct", "payload_within_3pct",
                                         "payload_at_most_10", "versus_20_bits"}
    scale = record["scale"]
    assert scale["peers"] == 20 and scale["deepreduce_bits"] == \
        record["bytes"]["sets"][-1]["by_k"]["64"]["payload_chunked"]
    seconds = [row["dense bf16 (ring allreduce)"]["seconds"] for row in scale["rows"]]
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(
        2 * 19 / 20 * 70e9 * 2 * 8 / 500e6)


def test_the_captured_pseudo_gradients_are_reused(outer, tmp_path):
    run(outer, tmp_path, "--parts", "scale")  # (captures nothing: no bytes part)
    assert not (tmp_path / "cache").exists()
    _, first = run(outer, tmp_path, "--parts", "bytes")
    _, second = run(outer, tmp_path, "--parts", "bytes")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    assert first["bytes"]["sets"][-1]["by_k"] == second["bytes"]["sets"][-1]["by_k"]


@pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0
                         and shutil.which("ip") and shutil.which("tc")),
                    reason="two network namespaces and tc need root and iproute2")
def test_the_time_part_across_two_namespaces(outer, tmp_path):
    text, record = run(outer, tmp_path, "--parts", "time", "--rates", "1gbit",
                       "--repeats", "2")
    assert "### Encode + decode on this CPU" in text and "#### 1gbit" in text
    (rate,) = record["time"]["rates"]
    results = rate["results"]
    assert len(results) >= 3
    for label, r in results.items():
        assert len(r["ms"]) == 2 and all(ms > 0 for ms in r["ms"])
        assert all(wire > 0 for wire in r["wire"])
    fp32 = results["allreduce fp32 (dense DiLoCo as sent elsewhere)"]
    sparse = [r for label, r in results.items() if "sparseloco" in label.lower()][0]
    # what crosses the veth: the dense buffer against a few kilobytes
    assert min(fp32["wire"]) > 10 * max(sparse["wire"])


def test_the_modules_examples_run(outer):
    import doctest

    from benchmarks import outer_time
    for module in (outer, outer_time):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted and not result.failed, module.__name__


def test_update_keeps_the_parts_it_did_not_run(tmp_path):
    from benchmarks.outer import carried_over

    earlier = dict(parts=["bytes", "time", "scale"], command="python -m benchmarks.outer",
                   bytes={"b": 1}, time={"t": 1}, scale={"s": 1})
    path = tmp_path / "outer.json"
    path.write_text(json.dumps(earlier))
    update = "python -m benchmarks.outer --parts time --update"
    record = carried_over(dict(parts=["time"], command=update, time={"t": 2}), path)
    assert record["parts"] == ["bytes", "time", "scale"]
    assert (record["bytes"], record["time"], record["scale"]) == ({"b": 1}, {"t": 2}, {"s": 1})
    assert record["command"].splitlines() == ["python -m benchmarks.outer",
                                              f"    {update}  # time anew"]
    path.write_text(json.dumps(record))  # a second update of the same part replaces the first
    again = carried_over(dict(parts=["time"], command=update, time={"t": 3}), path)
    assert again["command"] == record["command"] and again["time"] == {"t": 3}
