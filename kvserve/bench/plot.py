"""``--plot FILE.png``: throughput bars and latency distributions, one figure per command."""
from __future__ import annotations

from typing import Optional, Sequence


def plot_bench(path: str, title: str, bars: dict[str, float], bar_label: str,
               distributions: dict[str, dict[str, Sequence[float]]],
               line: Optional[tuple[str, dict[str, dict[int, float]]]] = None) -> None:
    """bars: engine -> value; distributions: metric label -> engine -> values (box plots);
    line: (y label, engine -> {x: y}) drawn as one more panel (the prefill sweep)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    panels = (1 if bars else 0) + len(distributions) + (1 if line else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(4.5 * max(panels, 1), 4), squeeze=False)
    axes = list(axes[0])
    if bars:
        ax = axes.pop(0)
        names = list(bars)
        ax.bar(range(len(names)), [bars[n] for n in names],
               color=["tab:green" if n == "kvserve" else "tab:gray" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(bar_label)
    for metric, by_engine in distributions.items():
        ax = axes.pop(0)
        names = [n for n, v in by_engine.items() if len(v)]
        if names:
            ax.boxplot([list(by_engine[n]) for n in names], showfliers=True)
            ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(metric)
    if line:
        ax = axes.pop(0)
        ylabel, series = line
        for name, points in series.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
