"""The project's benchmarks: run each from the repository root as ``python -m benchmarks.<name>``.

Their shared pieces (the gradient cache, timing, markdown tables) are in
:mod:`benchmarks.common`; results go to ``benchmarks/results/``.
"""
