"""Smoke tests of the set-up: packaging, console script, Horovod build, gradient capture.

They run in subprocesses so that TensorFlow, Horovod's launcher and TensorFlow's
op-determinism switch stay out of the test process.
"""

import importlib.util
import json
import os
import pathlib
import runpy
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
QUIET_TF = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def run_python(*args, cwd=REPO, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=QUIET_TF, timeout=timeout,
                          capture_output=True, text=True, check=True)


def test_core_import_needs_no_framework():
    code = ("import sys, deepreduce; "
            "print(sorted(m for m in ('tensorflow', 'horovod', 'sklearn') if m in sys.modules))")
    assert run_python("-c", code).stdout.strip() == "[]"


def test_codecs_subpackage_maps_to_codecs_folder_and_stdlib_codecs_stays():
    code = ("import codecs, deepreduce.codecs; "
            "print(deepreduce.codecs.__file__); print(hasattr(codecs, 'lookup'))")
    package_file, stdlib_codecs = run_python("-c", code).stdout.split()
    assert pathlib.Path(package_file).resolve() == REPO / "codecs" / "__init__.py"
    assert stdlib_codecs == "True"


#: (a module using the extension, its switch between compiled and numpy or None, the
#: extension). Each extension is built beside its user: deepreduce.codecs.x from codecs/x.c.
COMPILED = [
    ("deepreduce.codecs.bloom", "SCAN_IMPLEMENTATION", "deepreduce.codecs._bloomscan"),
    ("deepreduce.codecs._entropy", "IMPLEMENTATION", "deepreduce.codecs._entropyc"),  # Huffman...
    ("deepreduce.codecs.qsgd", "IMPLEMENTATION", "deepreduce.codecs._qsgd"),
    ("deepreduce.codecs.floats", "HALF_IMPLEMENTATION", "deepreduce.codecs._halfcast"),  # F16C
    ("deepreduce.bits", None, "deepreduce._varint"),  # the core's varints
    ("deepreduce.sparsifiers", "SCAN_IMPLEMENTATION", "deepreduce._topkscan"),
    ("deepreduce.collectives.base", "SUM_IMPLEMENTATION", "deepreduce.collectives._sparsesum"),
]


def folder_of(extension: str) -> pathlib.Path:
    """Where the source of ``extension`` lies and its build lands (setup.cfg's package_dir)."""
    package = extension.rsplit(".", 1)[0]
    return REPO / ("codecs" if package == "deepreduce.codecs" else package.replace(".", "/"))


@pytest.mark.parametrize("module, implementation, extension", COMPILED)
def test_install_compiled_the_c_extensions(module, implementation, extension):
    # The extensions are optional so that installs without a compiler work; this
    # machine has one, so a numpy fallback here means a broken build.
    attribute = extension.rsplit(".", 1)[1]
    active = f"module.{implementation}" if implementation else \
        f"'numpy' if module.{attribute} is None else 'compiled'"
    code = f"import {module} as module; print({active}); print(module.{attribute}.__file__)"
    active, module_file = run_python("-c", code).stdout.split()
    assert active == "compiled"
    assert pathlib.Path(module_file).resolve().parent == folder_of(extension)


def test_setup_builds_each_extension_from_the_source_beside_its_user():
    with mock.patch("setuptools.setup") as setup:  # the table, without a build
        runpy.run_path(str(REPO / "setup.py"))
    extensions = {e.name: e for e in setup.call_args.kwargs["ext_modules"]}
    assert set(extensions) == {extension for _, _, extension in COMPILED}
    for name, extension in extensions.items():
        source = folder_of(name) / (name.rsplit(".", 1)[1] + ".c")
        assert [REPO / s for s in extension.sources] == [source] and source.exists()
        assert extension.optional and "deepreduce/_buffer.h" in extension.depends
    if sys.platform != "win32":
        assert "-ffp-contract=off" in extensions["deepreduce.codecs._qsgd"].extra_compile_args
    # no build left at an old path, where it would shadow nothing and mislead
    built = {(folder_of(name), name.rsplit(".", 1)[1]) for name in extensions}
    stale = [str(path.relative_to(REPO)) for folder in ("deepreduce", "codecs")
             for path in (REPO / folder).rglob("*.so")
             if (path.parent, path.name.split(".")[0]) not in built]
    assert stale == []


def test_console_script_is_installed():
    script = pathlib.Path(sys.executable).with_name("deepreduce")
    assert script.exists(), f"{script} missing: is deepreduce installed in this interpreter?"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "bench" in result.stdout


HOROVOD_JOB = textwrap.dedent("""
    from horovod.runner import run

    def ragged_allgather():
        import numpy as np
        import tensorflow as tf
        import horovod.tensorflow as hvd

        hvd.init()
        mine = tf.constant(np.full(hvd.rank() + 2, hvd.rank() + 1, dtype=np.uint8))
        eager = hvd.allgather(mine).numpy().tolist()
        graph = tf.function(hvd.allgather)(mine).numpy().tolist()
        return hvd.rank(), hvd.size(), eager, graph

    if __name__ == "__main__":
        print(run(ragged_allgather, num_proc=2, use_gloo=True))
""")


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod not installed")
def test_horovod_two_ranks_allgather_ragged_uint8(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(HOROVOD_JOB)
    results = eval(run_python(str(script), cwd=tmp_path).stdout.strip().splitlines()[-1])
    expected = [1, 1, 2, 2, 2]
    assert results == [(0, 2, expected, expected), (1, 2, expected, expected)]


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tensorflow not installed")
def test_gradient_capture_layout_and_determinism(tmp_path):
    several, single = tmp_path / "several.npz", tmp_path / "single.npz"
    run_python("-m", "benchmarks.gradients", "--out", str(several), "--steps", "2",
               "--save-steps", "1,2", "--models", "resnet20,embedding", "--batch-size", "4")
    run_python("-m", "benchmarks.gradients", "--out", str(single), "--steps", "2",
               "--models", "embedding", "--batch-size", "4")
    with np.load(several) as a, np.load(single) as b:
        assert all(a[key].dtype == np.float32 for key in a.files
                   if not key.endswith(".indexed_indices"))

        resnet = [k for k in a.files if k.startswith("resnet20/step1/")]
        assert 260_000 < sum(a[k].size for k in resnet) < 280_000

        # The same model and seed give the same bits whatever else was trained.
        for key in b.files:
            np.testing.assert_array_equal(b[key], a[key.replace("embedding/", "embedding/step2/")])

        table = "embedding/embed/embeddings"
        dense = b[table]
        values, rows = b[table + ".indexed_values"], b[table + ".indexed_indices"]
        assert rows.dtype == np.int64 and values.shape == (rows.size, dense.shape[1])
        scattered = np.zeros_like(dense)
        np.add.at(scattered, rows, values)
        np.testing.assert_allclose(scattered, dense, rtol=1e-6, atol=1e-9)
        untouched = np.setdiff1d(np.arange(dense.shape[0]), rows)
        assert untouched.size and not dense[untouched].any()


def test_model_steps_benchmark_reports_every_shape_list(tmp_path):
    out = tmp_path / "steps.md"
    run_python("-m", "benchmarks.model_steps", "--steps", "1", "--warmup", "0", "--out", str(out))
    text = out.read_text()
    assert "| ResNet-50 | 2 | 161 (76) | 25,557,032 |" in text
    assert "| e2e MLP | 4 | 8 (7) | 8,546,314 |" in text
    assert json.loads(out.with_suffix(".json").read_text())["copy_gbytes_s"] > 0


def test_e2e_ratio_intervals_resample_whole_turns_of_both_schemes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # as `python -m benchmarks.e2e` from the root
    e2e = importlib.import_module("benchmarks.e2e")
    rng = np.random.default_rng(0)
    # 16 turns of 3 steps; the machine's load moves every turn's steps a lot, for both
    # schemes alike, and the second is 10% slower plus a little noise of its own
    load = np.repeat(rng.uniform(20, 60, 16), 3)
    fast = load + rng.normal(0, 0.2, 48)
    slow = 1.1 * load + rng.normal(0, 0.2, 48)
    assert e2e.paired_interval(fast, fast, 3) == (1.0, 1.0)
    low, high = e2e.paired_interval(slow, fast, 3)
    assert 1.05 < low < np.median(slow) / np.median(fast) < high < 1.15
    # with the turns' pairing broken, the load swamps the difference
    low, high = e2e.paired_interval(slow, rng.permutation(fast), 3)
    assert low < 1.0 < high
