"""What the benchmark scripts share: paths, the gradient cache, timing, markdown tables.

The scripts are modules of the ``benchmarks`` package, run from the repository
root: ``python -m benchmarks.codecs``. This module imports nothing beyond numpy,
so that the scripts that start TensorFlow, Horovod or torch ranks can use it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
#: The real gradients that ``python -m benchmarks.gradients`` captures (not committed).
GRADIENTS = HERE / "cache" / "gradients.npz"


# -- the gradient cache -------------------------------------------------------------------

def load_gradients(path=GRADIENTS) -> dict[str, np.ndarray]:
    """``{"<model>/<variable>": float32 gradient}`` from a cache of ``benchmarks.gradients``.

    The arrays have their variables' shapes and the file's order; the sparse
    companions of IndexedSlices gradients (``.indexed_values``,
    ``.indexed_indices``) are left out. A missing file is captured first (a
    minute or so, in a subprocess that keeps TensorFlow out of this one).
    """
    path = Path(path)
    if not path.exists():
        print(f"{path} is missing: capturing gradients with `python -m benchmarks.gradients` "
              "(about a minute)", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.gradients", "--out",
                        str(path.resolve())], cwd=ROOT, check=True)
    with np.load(path) as archive:
        return {key: archive[key] for key in archive.files if ".indexed_" not in key}


# -- timing -------------------------------------------------------------------------------

def best_of(fn, repeat: int, clock=time.perf_counter):
    """The shortest of ``repeat`` calls of ``fn`` in seconds of ``clock``, and the last
    call's result: ``(seconds, result)``. Each call's result is dropped before the next
    call, so that the allocator can reuse its memory, as in a loop that sends it on.

    >>> seconds, result = best_of(lambda: sum(range(10)), 3)
    >>> result, seconds >= 0
    (45, True)
    """
    best, result = float("inf"), None
    for _ in range(repeat):
        result = None
        start = clock()
        result = fn()
        best = min(best, clock() - start)
    return best, result


def best_wall_and_cpu(fn, repeat: int) -> tuple[float, float]:
    """The shortest wall-clock time and the shortest CPU time of this process over the
    same ``repeat`` calls of ``fn``, in seconds (for a figure that must hold on a machine
    shared with other jobs: the CPU time shows what the wall clock lost to them)."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def copy_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """This machine's memory copy bandwidth in GB/s (bytes read + written), best of a few."""
    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    seconds, _ = best_of(lambda: np.copyto(target, source), repeat)
    return 2 * nbytes / seconds / 1e9


# -- reports ------------------------------------------------------------------------------

def table(header, rows, right_aligned: bool = False) -> list[str]:
    """The lines of a markdown table; cells are written with ``str``. ``right_aligned``
    aligns every column after the first to the right (columns of figures).

    >>> table(["codec", "bits"], [["golomb", 7.5]], right_aligned=True)
    ['| codec | bits |', '|---|--:|', '| golomb | 7.5 |']
    """
    rule = ["---"] + ["--:" if right_aligned else "---"] * (len(header) - 1)
    return (["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
            + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def write_report(out, text: str, record=None) -> Path:
    """Write the markdown ``text`` to ``out``, making its folder, and ``record`` (when
    given) as JSON beside it, ``out`` with the suffix ``.json``. Returns ``out`` as a Path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if record is not None:
        out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float) + "\n")
    return out


# -- training scripts ---------------------------------------------------------------------

def mlp_shapes(hidden: int = 2048, layers: int = 3) -> list[tuple[int, ...]]:
    """Parameter shapes of the e2e benchmarks' MLP on the digits: 64-hidden x layers-10,
    each layer's weight then its bias."""
    widths = [64] + [hidden] * layers + [10]
    return [s for a, b in zip(widths, widths[1:]) for s in ((a, b), (b,))]


def add_compression_arguments(parser):
    """``--ratio``, ``--index`` and ``--value``: the deepreduce pipeline of a training demo."""
    parser.add_argument("--ratio", type=float, default=0.01, help="TopK ratio")
    parser.add_argument("--index", default="auto", help="index codec")
    parser.add_argument("--value", default="fp16", help="value codec")


def receive_bytes(conn, nbytes: int) -> int:
    """Read from the socket ``conn`` until ``nbytes`` have come or the sender closes;
    returns how many came (the receiving end of the bandwidth probes)."""
    got = 0
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    return got


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's master)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot_loss_curves(curves: dict, path, xlabel: str = "steps", ylim=None,
                     plain=()) -> bool:
    """``{label: [(step, loss), ...]}`` as validation-loss curves in a PNG at ``path``
    (``plain``: labels drawn without markers); False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for label, curve in curves.items():
        steps, losses = zip(*curve)
        axes.plot(steps, losses, marker=None if label in plain else ".", label=label)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("validation loss (nats per byte)")
    if ylim is not None:
        axes.set_ylim(*ylim)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True

