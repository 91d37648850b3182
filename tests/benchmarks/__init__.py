"""Measurement scripts, run as `python -m tests.benchmarks.NAME` (pytest collects none).

Importing the package loads the fast BLAS into the process first, before any script
imports MLX, as `kvchat` does at start-up (app/core/blas.py, `load_fast_blas`): each
script measures what users run. Where MLX is already imported (pytest) it does nothing.
"""

from kvchat.app.core import blas

blas.load_fast_blas()
