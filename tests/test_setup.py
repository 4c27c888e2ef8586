"""Smoke tests of the set-up: packaging, console script, Horovod build, gradient capture.

They run in subprocesses so that TensorFlow, Horovod's launcher and TensorFlow's
op-determinism switch stay out of the test process.

They run in a checkout (deepreduce installed in editable mode) and on an installed wheel
with the tests alone copied outside any checkout (make test-wheel), where the tests of the
checkout's own files (setup.py, the benchmarks) skip. There two variables say what was
built: DEEPREDUCE_EXPECT_IMPLEMENTATION=numpy for a wheel built with
DEEPREDUCE_NO_EXTENSIONS=1 (every numpy fallback must serve), and DEEPREDUCE_SDIST and
DEEPREDUCE_WHEEL, the files whose contents are checked.
"""

import importlib.util
import json
import os
import pathlib
import runpy
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from unittest import mock

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
QUIET_TF = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
#: "compiled" where a C compiler built the extensions (a checkout here, make test-wheel's
#: first wheel), "numpy" for a wheel built with DEEPREDUCE_NO_EXTENSIONS=1.
EXPECTED = os.environ.get("DEEPREDUCE_EXPECT_IMPLEMENTATION", "compiled")
#: the tests of the checkout's own files (setup.py, benchmarks/) skip without them
needs_checkout = pytest.mark.skipif(not (REPO / "setup.py").exists(),
                                    reason="the tests run without a checkout (an installed wheel)")


def run_python(*args, cwd=REPO, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=QUIET_TF, timeout=timeout,
                          capture_output=True, text=True, check=True)


def test_core_import_needs_no_framework():
    code = ("import sys, deepreduce; "
            "print(sorted(m for m in ('tensorflow', 'horovod', 'sklearn') if m in sys.modules))")
    assert run_python("-c", code).stdout.strip() == "[]"


def test_codecs_subpackage_maps_to_codecs_folder_and_stdlib_codecs_stays():
    code = ("import codecs, deepreduce, deepreduce.codecs; print(deepreduce.__file__); "
            "print(deepreduce.codecs.__file__); print(hasattr(codecs, 'lookup'))")
    core_file, package_file, stdlib_codecs = map(pathlib.Path, run_python("-c", code).stdout.split())
    core = core_file.resolve().parent
    # the checkout's codecs/ in editable mode; deepreduce/codecs/ where a wheel installed it
    expected = REPO / "codecs" if core == REPO / "deepreduce" else core / "codecs"
    assert package_file.resolve() == expected / "__init__.py"
    assert str(stdlib_codecs) == "True"


#: (a module using the extension, its switch between compiled and numpy or None, the
#: extension). Each extension is built beside its user: deepreduce.codecs.index.x from
#: codecs/index/x.c.
COMPILED = [
    ("deepreduce.codecs.index.bloom", "SCAN_IMPLEMENTATION", "deepreduce.codecs.index._bloomscan"),
    ("deepreduce.codecs.index._entropy", "IMPLEMENTATION",
     "deepreduce.codecs.index._entropyc"),  # Huffman, Golomb, blockpack, runs
    ("deepreduce.codecs.values.qsgd", "IMPLEMENTATION", "deepreduce.codecs.values._qsgd"),
    ("deepreduce.codecs.index.chunked", "IMPLEMENTATION", "deepreduce.codecs.index._chunkc"),
    ("deepreduce.codecs.values.floats", "HALF_IMPLEMENTATION",
     "deepreduce.codecs.values._halfcast"),  # F16C
    ("deepreduce.bits", None, "deepreduce._varint"),  # the core's varints
    ("deepreduce.sparsifiers", "SCAN_IMPLEMENTATION", "deepreduce._topkscan"),
    ("deepreduce.sums", "SUM_IMPLEMENTATION", "deepreduce._sparsesum"),
]


def folder_of(extension: str, root: pathlib.Path = REPO) -> pathlib.Path:
    """Where the source of ``extension`` lies and its build lands (setup.cfg's package_dir)."""
    package = extension.rsplit(".", 1)[0].split(".")
    if package[:2] == ["deepreduce", "codecs"]:  # deepreduce.codecs.index: codecs/index
        package = package[1:]
    return root.joinpath(*package)


@pytest.mark.parametrize("module, implementation, extension", COMPILED)
def test_install_compiled_the_c_extensions(module, implementation, extension):
    # The extensions are optional so that installs without a compiler work; this
    # machine has one, so a numpy fallback here means a broken build. A wheel built with
    # DEEPREDUCE_NO_EXTENSIONS=1 holds none of them, and every user runs its numpy path.
    attribute = extension.rsplit(".", 1)[1]
    package = extension.rsplit(".", 1)[0]
    active = f"module.{implementation}" if implementation else \
        f"'numpy' if module.{attribute} is None else 'compiled'"
    code = (f"import importlib.util, {module} as module, {package} as package; print({active}); "
            f"print(importlib.util.find_spec('{extension}') is not None); "
            f"print(package.__file__); print(getattr(module.{attribute}, '__file__', None))")
    active, installed, package_file, module_file = run_python("-c", code).stdout.split()
    assert active == EXPECTED
    if EXPECTED == "numpy":
        assert installed == "False", f"{extension} is installed, yet the build had no extensions"
        return
    # beside its package's modules: in the checkout's folders in editable mode
    assert pathlib.Path(module_file).resolve().parent == pathlib.Path(package_file).resolve().parent
    if (REPO / "setup.py").exists():
        assert pathlib.Path(module_file).resolve().parent == folder_of(extension)


def setup_call(monkeypatch, switch=None) -> dict:
    """The keywords setup.py hands setuptools.setup, without a build."""
    if switch is None:
        monkeypatch.delenv("DEEPREDUCE_NO_EXTENSIONS", raising=False)
    else:
        monkeypatch.setenv("DEEPREDUCE_NO_EXTENSIONS", switch)
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(REPO / "setup.py"))
    return setup.call_args.kwargs


@needs_checkout
def test_no_extensions_switch_builds_none(monkeypatch):
    assert setup_call(monkeypatch, "1")["ext_modules"] == []
    assert len(setup_call(monkeypatch, "0")["ext_modules"]) == len(COMPILED)
    assert len(setup_call(monkeypatch, "")["ext_modules"]) == len(COMPILED)


@needs_checkout
def test_setup_builds_each_extension_from_the_source_beside_its_user(monkeypatch):
    setup_call_kwargs = setup_call(monkeypatch)
    extensions = {e.name: e for e in setup_call_kwargs["ext_modules"]}
    assert set(extensions) == {extension for _, _, extension in COMPILED}
    for name, extension in extensions.items():
        source = folder_of(name) / (name.rsplit(".", 1)[1] + ".c")
        assert [REPO / s for s in extension.sources] == [source] and source.exists()
        assert extension.optional and "deepreduce/_buffer.h" in extension.depends
    if sys.platform != "win32":
        assert "-ffp-contract=off" in extensions["deepreduce.codecs.values._qsgd"].extra_compile_args
    # no build left at an old path, where it would shadow nothing and mislead
    built = {(folder_of(name), name.rsplit(".", 1)[1]) for name in extensions}
    stale = [str(path.relative_to(REPO)) for folder in ("deepreduce", "codecs")
             for path in (REPO / folder).rglob("*.so")
             if (path.parent, path.name.split(".")[0]) not in built]
    assert stale == []


@pytest.mark.skipif(not os.environ.get("DEEPREDUCE_SDIST") or not os.environ.get("DEEPREDUCE_WHEEL"),
                    reason="DEEPREDUCE_SDIST and DEEPREDUCE_WHEEL name no build (make test-wheel does)")
def test_sdist_and_wheel_hold_the_package(tmp_path, monkeypatch):
    sdist, wheel = pathlib.Path(os.environ["DEEPREDUCE_SDIST"]), pathlib.Path(os.environ["DEEPREDUCE_WHEEL"])
    with tarfile.open(sdist) as archive:  # deepreduce-VERSION/...: paths below that folder
        members = [m for m in archive.getmembers() if m.isfile()]
        top = members[0].name.split("/")[0]
        (tmp_path / "setup.py").write_bytes(archive.extractfile(f"{top}/setup.py").read())
    in_sdist = {m.name.split("/", 1)[1] for m in members}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())

    # the sdist builds the package: setup.py's table of sources (read as the build does)
    # and the header they share, every module, the whole test suite with its fixtures
    monkeypatch.delenv("DEEPREDUCE_NO_EXTENSIONS", raising=False)
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(tmp_path / "setup.py"))
    extensions = setup.call_args.kwargs["ext_modules"]
    sources = {source for extension in extensions for source in extension.sources}
    assert len(sources) == len(COMPILED)
    needed = {"setup.py", "setup.cfg", "pyproject.toml", "README.md", "deepreduce/_buffer.h",
              "tests/extensions.py", "tests/test_setup.py"} | sources
    assert needed - in_sdist == set()
    fixtures = {pathlib.PurePath(name).suffix for name in in_sdist if name.startswith("tests/fixtures/")}
    assert fixtures >= {".drz", ".npz"}  # golden payloads and their inputs
    stray = [name for name in in_sdist
             if name.endswith((".so", ".pyc", ".pyd")) or "__pycache__" in name
             or name.split("/")[0] in ("benchmarks", "notebooks", "docs", "examples", "build", "dist")]
    assert stray == []

    # the wheel: every module at its installed path (codecs/ becomes deepreduce/codecs/),
    # the extensions compiled (none where the build had DEEPREDUCE_NO_EXTENSIONS=1), and
    # nothing else: no C source, no test
    modules = {("deepreduce/" + name if name.startswith("codecs/") else name)
               for name in in_sdist if name.endswith(".py") and name.startswith(("deepreduce/", "codecs/"))}
    assert modules - in_wheel == set()
    built = {name for name in in_wheel if name.endswith((".so", ".pyd"))}
    if EXPECTED == "numpy":
        assert built == set() and wheel.name.endswith("-py3-none-any.whl")
    else:
        assert {name.split(".")[0].replace("/", ".") for name in built} == \
            {extension.name for extension in extensions}
    assert {name.split("/")[0] for name in in_wheel} == {"deepreduce", top + ".dist-info"}
    assert [name for name in in_wheel if name.endswith((".c", ".h"))] == []


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


@needs_checkout
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


@needs_checkout
def test_model_steps_benchmark_reports_every_shape_list(tmp_path):
    out = tmp_path / "steps.md"
    run_python("-m", "benchmarks.model_steps", "--steps", "1", "--warmup", "0", "--out", str(out))
    text = out.read_text()
    assert "| ResNet-50 | 2 | 161 (76) | 25,557,032 |" in text
    assert "| e2e MLP | 4 | 8 (7) | 8,546,314 |" in text
    assert json.loads(out.with_suffix(".json").read_text())["copy_gbytes_s"] > 0


@needs_checkout
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
