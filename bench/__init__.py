"""ffstate's benchmarks, installed as ``ffstate.bench`` and run by ``ffstate bench NAME``.

Each measures ratios side by side in one run, prints a table, and writes JSON (and a PNG plot)
under ``bench/results/``.
"""
