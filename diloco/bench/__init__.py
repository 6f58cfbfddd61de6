"""Benchmarks: `diloco bench overhead|convergence|codec|transport|recovery|faults|fuzz|byzantine|load|soak`.

Each prints one JSON object.

Why a package apart from the product: a benchmark measures the product (diloco/, islands/, transport/) and is
never imported by it. One module per benchmark (codec, convergence, federation (recovery and faults), overhead,
transport, fuzz, byzantine, load, soak); cli.py owns the `bench` subcommands and the dispatch, so diloco/cli.py only
calls `add_bench_parser` and `run_bench`. Nothing here imports JAX until a benchmark runs (`diloco --help` stays fast).
Committed results live under benchmarks/ at the repository root; BENCHMARKS.md gives the commands and figures.
"""
