"""libFuzzer's entry point for one target of diloco/bench/fuzz_decoders.py.

    python -m diloco.bench.fuzz_entry TARGET [libFuzzer flags: -runs=N -max_total_time=S ...]

A module of its own because atheris must instrument the decoding modules as they are first imported, and
fuzz_decoders imports them at its top: here they are imported inside `atheris.instrument_imports` first (only
`transport` and `floor`: instrumenting JAX and numpy as well would take minutes and tell nothing about our code).
"""

from __future__ import annotations

import sys


def main() -> None:
    import atheris

    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m diloco.bench.fuzz_entry TARGET [libFuzzer flags]")
    target = sys.argv.pop(1)
    with atheris.instrument_imports(include=["transport", "floor"]):
        import floor.codec  # noqa: F401
        import transport.chunking
        import transport.tensors
        import transport.validate
        import transport.wire  # noqa: F401
    from diloco.bench.fuzz_decoders import TARGETS

    if target not in TARGETS:
        sys.exit(f"unknown target {target!r} (targets: {', '.join(TARGETS)})")
    atheris.Setup(sys.argv, TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
