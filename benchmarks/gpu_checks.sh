#!/usr/bin/env bash
# The checks that need a GPU (docs/cuda.md), in one run of at most 8 minutes on one H100:
#   1. the machine: GPU, driver, torch, numpy, which compiled extensions built;
#   2. benchmarks/gpu_check.py: (a) DDP on NCCL, world of 1, device path / device path
#      under a side stream / host path: identical weights, state_dict() round trip;
#      (b) the stream-coupling probe; (c) ResNet-50 and GPT-2 small: the hook against
#      allreduce_hook and PowerSGD rank 1, step time and host syncs per step;
#      (d) the FSDP2 replica exchange where it has landed;
#   3. the CUDA tests (tests/test_torch_cuda.py, the Lightning example among them), the
#      device-path tests and tests/test_cuda_path.py on that machine's torch and numpy;
#   4. benchmarks/device_step.py on the GPU: the hooks' own work per step.
#
#   bash benchmarks/gpu_checks.sh             # on a GPU: writes under $OUT, else benchmarks/results/gpu
#   bash benchmarks/gpu_checks.sh --dry-run   # anywhere: the same steps on the CPU (gloo,
#                                             # no CUDA parts, small shapes), in a temporary
#                                             # folder; tests/test_gpu_checks.py runs it
#
# Each step has a time limit (their sum, with the set-up, is 8 minutes). Made for a short
# lease of a GPU machine whose Python already holds torch (and, for the Lightning test,
# Lightning) but not deepreduce's own dependencies: wheels in .whl/ are installed first,
# with nothing fetched. Fetch them beforehand, where pip works, for that machine's Python
# (3.12 here):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       zstandard mmh3
#
# Every step runs, whatever failed before it; the exit status says whether all passed.
set -uo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
elif [[ $# -gt 0 ]]; then
    echo "usage: bash benchmarks/gpu_checks.sh [--dry-run]" >&2
    exit 2
fi
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [[ $dry_run == 1 ]]; then
    out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks_dry_run.XXXXXX")
else
    out=${OUT:-benchmarks/results/gpu}
    if ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        echo "no CUDA device here: run with --dry-run" >&2
        exit 2
    fi
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/deepreduce-site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/deepreduce-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # (the C extensions are optional: the log says which compiled)
    "$python" -m pip install -q --no-index --no-build-isolation --no-deps -e . || exit 1
fi
mkdir -p "$out"
echo "writing under $out"
failed=0
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, note a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    if [[ $status != 0 ]]; then
        echo "== $name FAILED (exit status $status)"
        failed=1
    fi
}

{
    [[ $dry_run == 1 ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" - <<'EOF'
import importlib, pathlib, re, numpy, torch
# the compiled extensions as setup.py lists them, so that this list cannot go stale
names = re.findall(r'\("(deepreduce(?:\.\w+)+)", "[\w/]+\.c"', pathlib.Path("setup.py").read_text())
built = []
for name in names:
    try:
        importlib.import_module(name)
        built.append(name.rsplit(".", 1)[1])
    except ImportError:
        pass
print("torch", torch.__version__, "CUDA", torch.version.cuda, "numpy", numpy.__version__,
      f"compiled extensions ({len(built)} of {len(names)}):", ", ".join(built) or "none")
EOF
} 2>&1 | tee "$out/machine.txt"

if [[ $dry_run == 1 ]]; then
    step gpu_check 120 "$python" -m benchmarks.gpu_check --dry-run --out "$out/gpu_check.md"
    # (the test files run in the suite itself; the device_step command line is checked here)
    step device_step 120 "$python" -m benchmarks.device_step --device cpu --models mlp \
        --ranks 2 --steps 1 --warmup 1 --topk-repeats 0 --out "$out/device_step.md"
else
    step gpu_check 120 "$python" -m benchmarks.gpu_check --out "$out/gpu_check.md"
    step cuda_tests 150 "$python" -m pytest -q -p no:cacheprovider tests/test_torch_cuda.py \
        tests/test_torch_device.py tests/test_cuda_path.py
    step device_step 180 "$python" -m benchmarks.device_step --models resnet50 gpt2 \
        --ranks 2 8 --steps 5 --topk-repeats 10 --out "$out/device_step_cuda.md"
fi
echo "== done: $([[ $failed == 0 ]] && echo "every step passed" || echo "a step FAILED"); \
results under $out"
exit $failed
