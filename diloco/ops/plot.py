"""`diloco plot`: the global model's eval loss of one or more run directories, or one of its post-training
held-out figures (`--figure sft_exact_match`, a key of the events' `scores`), against inner steps, tokens, WAN bytes
or wall time, as PNG figures (README.md, "Commands").

Two halves, so that the first is testable (and usable from a notebook) without matplotlib:

    read_curve(run_dir) -> Curve   metrics.jsonl + config.toml -> one point per evaluation of the global model
    draw(curves, out, axes)        matplotlib (Agg: no display needed), imported only here

The points are the `eval` event at step 0 (θ_0) and every commit's `round` event (`sync` too with streaming: each
fragment's commit is evaluated). Each commit's x values:

    steps   inner steps per island when it was committed: commit s = round·P + fragment lands at (s+1)·H/P
            (P = stream.fragments, the round's last fragment at (round+1)·H). In train.mode "async" a round is one
            island's update, so update u counts as (u+1)·H/islands.count steps per island: the same compute per
            island as a synchronous round when the islands take turns evenly.
    tokens  the event's `tokens`, the run's cumulative total
    bytes   the event's `bytes_up + bytes_down`, cumulative WAN bytes
    wall    the event's `t`, seconds since the run started (continued across resumes)

`train.mode = "sync"` (the data-parallel baseline) logs a `round` event every H steps with the same fields, so it
reads the same way and overlays DiLoCo on the same axes.

A figure other than EVAL_LOSS is read from the same events' `scores` (docs/metrics.md); an event without it is no
point, and a run without any point of it is a PlotError naming the figures the run has.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.run.positions import commit_position, steps_per_commit
from floor.errors import UserError

if TYPE_CHECKING:
    from diloco.config import RunConfig

X_AXES = ("steps", "tokens", "bytes", "wall")
"""The x axes `diloco plot --x` offers, in the order of the default 2x2 grid; each is a field of `Point`."""

X_LABELS = {
    "steps": "inner steps per island",
    "tokens": "tokens (all islands)",
    "bytes": "WAN bytes, up + down (symlog)",
    "wall": "wall time (s)",
}
ASYNC_STEPS_NOTE = " (async: (update+1)·H/islands)"
"""Appended to the steps label when an async run is drawn: its x is an equivalent, not a count (module docstring)."""

EVAL_LOSS = "eval_loss"
"""The default figure: the events' own eval_loss."""

INSTALL_HINT = "matplotlib is not installed; `diloco plot` needs it: pip install 'diloco[plot]'"


class PlotError(UserError):
    """A run directory that cannot be plotted, or a figure that cannot be written: one line, exit code 2."""


@dataclass(frozen=True)
class Point:
    """One evaluation of the global model (its figure's value) and where the run stood then."""

    steps: float
    tokens: int
    bytes: int
    wall: float
    value: float


@dataclass(frozen=True)
class Curve:
    """A run directory's curve of one figure: points in commit order, x strictly increasing in steps."""

    label: str
    mode: str
    points: tuple[Point, ...]
    figure: str = EVAL_LOSS

    def xs(self, axis: str) -> list[float]:
        """The points' x values on `axis` (one of X_AXES)."""
        return [float(getattr(p, axis)) for p in self.points]

    @property
    def values(self) -> list[float]:
        return [p.value for p in self.points]


# -- reading --------------------------------------------------------------------------------------------------------


def read_curve(run_dir: Path, label: str | None = None, figure: str = EVAL_LOSS) -> Curve:
    """The curve of `figure` (module docstring) of one run directory, labelled `label` or the directory's name;
    PlotError when it has none."""
    from diloco.run.rundir import read_events  # with the config loader: read when a curve is, not at `diloco --help`

    metrics = _checked_metrics(run_dir)
    cfg = _run_config(run_dir)
    events = read_events(metrics)
    points = _initial_points(events, figure) + _commit_points(events, cfg, figure)
    if not points and figure == EVAL_LOSS:
        raise PlotError(f"run dir '{run_dir}' has no eval points yet (no `eval` or `round` event in metrics.jsonl)")
    if not points:
        held = sorted({k for e in events for k in (e.get("scores") or {}) if isinstance(k, str)})
        has = f"its figures: {', '.join([EVAL_LOSS, *held])}" if held else f"it has only {EVAL_LOSS}"
        raise PlotError(f"run dir '{run_dir}' has no {figure!r} point ({has})")
    return Curve(label=label or _default_label(run_dir), mode=cfg.train.mode, points=tuple(points), figure=figure)


def read_curves(run_dirs: Sequence[Path], labels: Sequence[str] = (), figure: str = EVAL_LOSS) -> list[Curve]:
    """One curve of `figure` per run directory; `labels`, when given, name them in order (one per directory)."""
    if labels and len(labels) != len(run_dirs):
        raise PlotError(f"--label given {len(labels)} times for {len(run_dirs)} run dirs: give one per run dir")
    return [read_curve(d, labels[i] if labels else None, figure) for i, d in enumerate(run_dirs)]


def _checked_metrics(run_dir: Path) -> Path:
    """RUN_DIR/metrics.jsonl, checked first so that a typo in a path is named as such (not as a config problem)."""
    if not run_dir.exists():
        raise PlotError(f"run dir '{run_dir}' does not exist")
    if not run_dir.is_dir():
        raise PlotError(f"run dir '{run_dir}' is not a directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"run dir '{run_dir}' has no metrics.jsonl (is it a run directory?)")
    return metrics


def _run_config(run_dir: Path) -> RunConfig:
    """The run's resolved config.toml through the config loader (`from_dict`: keys a newer diloco added take their
    defaults). Not `load_config`: that refuses the redacted placeholder a dumped literal secret becomes, which
    says nothing about the curve."""
    from diloco.config import RunConfig, from_dict

    path = run_dir / "config.toml"
    try:
        return from_dict(RunConfig, tomllib.loads(path.read_text()))
    except OSError as exc:
        raise PlotError(f"run dir '{run_dir}': config.toml is unreadable ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise PlotError(f"run dir '{run_dir}': config.toml does not load ({exc})") from None


def _default_label(run_dir: Path) -> str:
    return run_dir.resolve().name or str(run_dir)


def _value(event: dict[str, Any], figure: str) -> float | None:
    """The event's value of `figure`: its eval_loss, or that key of its `scores`."""
    if figure == EVAL_LOSS:
        return _number(event.get(EVAL_LOSS))
    scores = event.get("scores")
    return _number(scores.get(figure)) if isinstance(scores, dict) else None


def _initial_points(events: list[dict[str, Any]], figure: str = EVAL_LOSS) -> list[Point]:
    """θ_0's evaluation (the `eval` event at step 0), before any token or byte: at most one point."""
    for e in events:
        value = _value(e, figure)
        if e.get("event") == "eval" and e.get("step", 0) == 0 and value is not None:
            return [Point(steps=0.0, tokens=0, bytes=0, wall=float(e.get("t", 0.0)), value=value)]
    return []


def _commit_points(events: list[dict[str, Any]], cfg: RunConfig, figure: str = EVAL_LOSS) -> list[Point]:
    """One point per evaluated commit, in commit order. Keyed by the commit's position, the last event winning, so
    that a position logged twice (a commit rerun after a restart whose log was not truncated) is one point."""
    fragments, per_commit = cfg.stream.fragments, steps_per_commit(cfg)
    by_position: dict[int, Point] = {}
    for e in events:
        value = _value(e, figure)
        if e.get("event") not in ("round", "sync") or value is None or not isinstance(e.get("round"), int):
            continue
        position = commit_position(e["event"], e, fragments)
        by_position[position] = Point(
            steps=(position + 1) * per_commit,
            tokens=int(e.get("tokens", 0)),
            bytes=int(e.get("bytes_up", 0)) + int(e.get("bytes_down", 0)),
            wall=float(e.get("t", 0.0)),
            value=value,
        )
    return [by_position[s] for s in sorted(by_position)]


def _number(value: object) -> float | None:
    """A JSON number as a float (NaN too: a point worth seeing), else None (null, missing, a bool, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


# -- drawing --------------------------------------------------------------------------------------------------------


def default_out(axis: str | None, figure: str = EVAL_LOSS) -> Path:
    """Where a figure goes without --out: the current directory, named after what it shows."""
    return Path(f"{figure}.png" if axis is None else f"{figure}_vs_{axis}.png")


def axis_label(axis: str, curves: Sequence[Curve]) -> str:
    """The x label of `axis`; the steps of an async run are an equivalent, and the label says so."""
    note = ASYNC_STEPS_NOTE if axis == "steps" and any(c.mode == "async" for c in curves) else ""
    return X_LABELS[axis] + note


def draw(curves: Sequence[Curve], out: Path, axes: Sequence[str] = X_AXES, title: str | None = None) -> Path:
    """Write one PNG with a panel per x axis in `axes` (a 2x2 grid for all four), every curve in every panel."""
    plt = _pyplot()
    ncols = 2 if len(axes) > 1 else 1
    nrows = math.ceil(len(axes) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.4 * nrows), squeeze=False)
    try:
        for ax, axis in zip(grid.flat, axes, strict=False):
            _panel(ax, axis, curves)
        fig.suptitle(title or f"global model {_y_label(curves)}")
        fig.tight_layout()
        _save(fig, out)
    finally:
        plt.close(fig)
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only: no display, no GUI toolkit), or PlotError with the
    install line. matplotlib is an optional dependency (the `plot` extra): training never needs it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel(ax: Any, axis: str, curves: Sequence[Curve]) -> None:
    """Eval loss against one x axis. Bytes are symlog: the data-parallel baseline moves about H times DiLoCo's
    bytes, so on a linear axis DiLoCo's curve would be squeezed against zero; the linear band below the smallest
    positive value keeps θ_0's point at 0 bytes."""
    for c in curves:
        ax.plot(c.xs(axis), c.values, marker="o", markersize=3, label=c.label)
    if axis == "bytes":
        positive = [x for c in curves for x in c.xs(axis) if x > 0]
        if positive:
            ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel(axis_label(axis, curves))
    ax.set_ylabel(_y_label(curves))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _y_label(curves: Sequence[Curve]) -> str:
    figure = curves[0].figure if curves else EVAL_LOSS
    return "eval loss" if figure == EVAL_LOSS else f"held-out {figure}"


def _save(fig: Any, out: Path) -> None:
    try:
        fig.savefig(out, format="png", dpi=120)
    except OSError as exc:
        raise PlotError(f"cannot write '{out}' ({exc.strerror or exc})") from None


def plot(
    run_dirs: Sequence[Path],
    out: Path | None = None,
    axis: str | None = None,
    labels: Sequence[str] = (),
    title: str | None = None,
    figure: str = EVAL_LOSS,
) -> list[Path]:
    """`diloco plot`: read every run directory (all checked before anything is drawn), write the figure, return the
    files written. With `axis` one panel against it, else the 2x2 grid of X_AXES."""
    curves = read_curves(run_dirs, labels, figure)
    axes = X_AXES if axis is None else (axis,)
    return [draw(curves, out or default_out(axis, figure), axes, title)]


def draw_ratio_against_size(rows: Sequence[dict[str, Any]], out: Path, islands: int, inner_steps: int) -> Path:
    """`diloco bench scaling --plot`: LM / Ls (each method at its best) against parameters, log x, one point per
    size, with the line of parity; as the scaling-laws paper (arXiv 2503.09799) draws DiLoCo's gap."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    try:
        params = [row["parameters"] for row in rows]
        ratios = [row["ratio_LM_over_Ls"] for row in rows]
        ax.plot(params, ratios, marker="o", label=f"DiLoCo M = {islands}, H = {inner_steps}")
        for row in rows:
            ax.annotate(
                row["size"],
                (row["parameters"], row["ratio_LM_over_Ls"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize="small",
            )
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="data-parallel")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # decades only: minor labels collide at 3, 4, 6 x 10^k
        ax.set_xlabel("parameters")
        ax.set_ylabel("eval loss: DiLoCo / data-parallel")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize="small")
        fig.suptitle("DiLoCo's gap against model size (each method at its best)")
        fig.tight_layout()
        _save(fig, out)
    finally:
        plt.close(fig)
    return out
