"""Pictures of simulations: a timeline, and a what-if curve (needs matplotlib: grape[plot])."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from grape.errors import GrapeError
from grape.sim.engine import SimResult

__all__ = ["plot_simulation"]


def plot_simulation(path: str | Path, result: SimResult, title: str,
                    curve: Sequence[tuple[str, Sequence[float], Sequence[float]]],
                    curve_label: str) -> Path:
    """Save a PNG: the first iteration's timeline above, ``curve`` (label, x, y ms) below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise GrapeError("expected matplotlib for --plot (pip install 'grape[plot]'), found "
                         "none") from None
    first_end = result.iteration_times[0] if result.iteration_times else result.end
    shown = [i for i in result.intervals if i.start < first_end]
    tracks = sorted({i.track for i in shown}, key=lambda t: (t != "host", t))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5),
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    colors = {"HostWork": "#9e9e9e", "Launch": "#1f77b4", "GraphLaunch": "#2ca02c",
              "Sync": "#d62728"}
    for row, track in enumerate(tracks):
        spans = [(i.start / 1000, (i.end - i.start) / 1000, colors.get(i.name, "#ff7f0e"))
                 for i in shown if i.track == track]
        top.broken_barh([(s, w) for s, w, _ in spans], (row - 0.4, 0.8),
                        facecolors=[c for _, _, c in spans])
    top.set_yticks(range(len(tracks)), tracks)
    top.set_xlabel("ms")
    top.set_title(f"{title}: first simulated iteration (host: grey work, blue launches, "
                  f"green graph launches, red syncs; streams: orange)", fontsize=9)
    for label, xs, ys in curve:
        bottom.plot(xs, ys, marker="o", label=label)
    bottom.set_xlabel(curve_label)
    bottom.set_ylabel("predicted ms per iteration")
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
