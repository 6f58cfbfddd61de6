"""Named sets of config overrides that a bench runs side by side: `NAME:section.key=v[,section.key=v...]`.

`diloco bench scaling --size` (a model size) and `diloco bench utilization --variant` (a codec and its outer rule,
say) take them; NAME names the variant's run directory and its row in the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.bench.errors import BenchError


@dataclass(frozen=True)
class Variant:
    """A name and its overrides of the config."""

    name: str
    overrides: tuple[str, ...]


def parse_variant(spec: str, flag: str) -> Variant:
    """`"S:model.d_model=32,model.n_layers=2"` -> Variant("S", ("model.d_model=32", "model.n_layers=2")); a
    malformed spec is a BenchError naming `flag`. Values are text: the config's own parser validates them."""
    name, sep, rest = spec.partition(":")
    overrides = tuple(o for o in rest.split(",") if o)
    if not sep or not name.isidentifier() or not overrides or any("=" not in o for o in overrides):
        raise BenchError(f"{flag} {spec!r} must look like NAME:section.key=v[,section.key=v...] (NAME a word)")
    return Variant(name, overrides)


def parse_variants(specs: list[str], flag: str) -> list[Variant]:
    """Every spec parsed, their names distinct."""
    variants = [parse_variant(spec, flag) for spec in specs]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise BenchError(f"{flag}: the names must be distinct (got {names})")
    return variants
