#!/usr/bin/env bash
# The checks that need a GPU, in one run on a machine that has one: the CUDA tests
# (tests/test_torch_cuda.py, the Lightning example among them), the device-path tests
# on that machine's torch and numpy, and benchmarks/device_step.py on the GPU.
#
#   bash benchmarks/gpu_checks.sh          # writes under $OUT, else benchmarks/results/gpu
#
# Made for a short lease of a GPU machine whose Python already holds torch (and, for
# the Lightning test, Lightning) but not deepreduce's own dependencies: wheels in .whl/
# are installed first, with nothing fetched. Fetch them beforehand, where pip works,
# for that machine's Python (3.12 here):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       zstandard mmh3
#
# Every step runs, whatever failed before it; the exit status says whether all passed.
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/deepreduce-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/deepreduce-site${PYTHONPATH:+:$PYTHONPATH}
fi
# (the C extensions are optional: the log says which compiled)
"$python" -m pip install -q --no-index --no-build-isolation --no-deps -e . || exit 1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" - <<'EOF'
import importlib, numpy, torch
built = []
for name in ("deepreduce._varint", "deepreduce._topkscan", "deepreduce._sparsesum",
             "deepreduce.codecs.index._entropyc", "deepreduce.codecs.values._halfcast",
             "deepreduce.codecs.values._qsgd", "deepreduce.codecs.index._bloomscan"):
    try:
        importlib.import_module(name)
        built.append(name.rsplit(".", 1)[1])
    except ImportError:
        pass
print("torch", torch.__version__, "CUDA", torch.version.cuda, "numpy", numpy.__version__,
      "compiled extensions:", ", ".join(built) or "none")
EOF
} 2>&1 | tee "$out/machine.txt"
failed=0
"$python" -m pytest -q -p no:cacheprovider tests/test_torch_cuda.py tests/test_torch_device.py \
    2>&1 | tee "$out/cuda_tests.log" || failed=1
"$python" -m benchmarks.device_step --out "$out/device_step_cuda.md" \
    2>&1 | tee "$out/device_step_cuda.log" || failed=1
exit $failed
