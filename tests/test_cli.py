import json
import subprocess
import sys

import numpy as np
import pytest

import deepreduce as dr
from deepreduce.cli import main


@pytest.fixture
def grad_file(tmp_path):
    g = np.random.default_rng(0).standard_normal((100, 50)).astype(np.float32)
    path = tmp_path / "grad.npy"
    np.save(path, g)
    return path, g


def test_compress_decompress_inspect(grad_file, tmp_path, capsys):
    path, g = grad_file
    drz, back = tmp_path / "grad.drz", tmp_path / "back.npy"
    assert main(["compress", str(path), "-o", str(drz), "--sparsifier", "topk:0.01",
                 "--index", "eliasfano", "--value", "fp16"]) == 0
    assert main(["decompress", str(drz), "-o", str(back)]) == 0
    dense = np.load(back)
    assert dense.shape == g.shape and dense.dtype == g.dtype
    kept = dense != 0
    assert kept.sum() == 50
    np.testing.assert_allclose(dense[kept], g[kept], rtol=1e-3)
    capsys.readouterr()
    assert main(["inspect", str(drz), "--json", "--check"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["nnz"] == 50 and info["index_codec"] == "eliasfano" and info["value_codec"] == "fp16"
    assert info["total_bytes"] == drz.stat().st_size and info["decodes"] is True


def test_decompress_sparse_output(grad_file, tmp_path):
    path, g = grad_file
    drz, out = tmp_path / "g.drz", tmp_path / "g.npz"
    main(["compress", str(path), "-o", str(drz), "--sparsifier", "topk:k=7"])
    main(["decompress", str(drz), "-o", str(out), "--sparse"])
    with np.load(out) as z:
        assert z["values"].size == 7 and tuple(z["shape"]) == g.shape


def test_corrupt_payload_is_a_clean_error(grad_file, tmp_path, capsys):
    path, _ = grad_file
    drz = tmp_path / "g.drz"
    main(["compress", str(path), "-o", str(drz), "--sparsifier", "topk:0.1"])
    drz.write_bytes(drz.read_bytes()[:-3])
    assert main(["decompress", str(drz)]) == 1
    assert "DecodeError" in capsys.readouterr().err


def test_bad_codec_name_is_a_clean_error(grad_file, capsys):
    path, _ = grad_file
    assert main(["compress", str(path), "--index", "nosuch"]) == 1
    assert "unknown index codec" in capsys.readouterr().err


def test_bench_lists_every_codec(tmp_path, capsys):
    arrays = {"a": np.random.default_rng(1).standard_normal(5000).astype(np.float32),
              "b": np.random.default_rng(2).standard_normal((30, 30)).astype(np.float32)}
    path = tmp_path / "grads.npz"
    np.savez(path, **arrays)
    assert main(["bench", str(path), "--sparsifier", "topk:0.05", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for family in ("index", "value"):
        for codec_id in dr.registered_codecs(family):
            assert f"\n{codec_id} " in out, codec_id
    assert "2 tensors" in out and "nnz 295" in out


def test_help_explains_every_codec():
    out = subprocess.run([sys.executable, "-m", "deepreduce.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for family in ("index", "value"):
        for codec_id, cls in dr.registered_codecs(family).items():
            assert f"  {codec_id} " in out
            for p in cls._parameters():
                assert f"{p.name}=" in out
    assert "topk:R" in out


def test_inspect_reads_bundles(tmp_path, capsys):
    from deepreduce.exchange import GradientExchange

    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in ((5000,), (8,), (3, 4))]
    bundle = GradientExchange(sparsifier=dr.TopK(0.01), index="golomb", value="fp16").encode_bundle(
        ["w", "b", "c"], grads)
    path = tmp_path / "step.drb"
    path.write_bytes(bundle + bundle)   # what an allgather of two ranks holds
    assert main(["inspect", str(path), "--json", "--check", "--ranks", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["bundles"]) == 2
    first = info["bundles"][0]
    assert first["bundle_version"] == 3 and first["total_bytes"] == len(bundle)
    assert first["tensors"] == [{"payload": 0}, {"payload": 1, "shape": [8]},
                                {"payload": 1, "shape": [3, 4]}]
    assert [p["nnz"] for p in first["payloads"]] == [50, 20]
    assert all(p["decodes"] for p in first["payloads"])
    assert main(["inspect", str(path), "--ranks", "2"]) == 0
    text = capsys.readouterr().out
    assert "bundle 1: version 3" in text and "tensor 2: payload 1, shape (3, 4)" in text
    assert main(["inspect", str(path)]) == 1   # two bundles read as one
    assert "DecodeError" in capsys.readouterr().err
