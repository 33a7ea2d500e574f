"""docs/performance.png: one panel per section (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from .report import median

OURS_COLOR = "#d62728"
PEER_COLOR = "#7f7f7f"
FLOOR_COLOR = "#1f77b4"


def plot(results: dict[str, Any], path: Path, subtitle: str) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    fig.suptitle(f"celery-singleton-lock benchmarks  ({subtitle})", fontsize=12)
    _lock_cycle(axes[0][0], results.get("lock_cycle"))
    _throughput(axes[0][1], results.get("throughput"))
    _renewal(axes[0][2], results.get("renewal"))
    _contention(axes[1][0], results.get("contention"))
    _beat(axes[1][1], results.get("beat"))
    _duplicates(axes[1][2], results.get("duplicates"))
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _missing(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _lock_cycle(ax: Any, data: Any) -> None:
    title = "1. Lock cycle (acquire + release), µs"
    if not data:
        return _missing(ax, title)
    rows = sorted(data, key=lambda r: r.median_us, reverse=True)
    names = [r.name for r in rows]
    values = [r.median_us for r in rows]
    colors = [
        FLOOR_COLOR if "PING" in n else OURS_COLOR if "singleton-lock" in n else PEER_COLOR
        for n in names
    ]
    ax.barh(names, values, color=colors)
    floor = next(r.median_us for r in rows if "PING" in r.name)
    ax.axvline(floor * 1.15, color=FLOOR_COLOR, linestyle="--", linewidth=1)
    ax.text(floor * 1.15, -0.6, " target: 1.15x two PINGs", color=FLOOR_COLOR, fontsize=8)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.set_title(title)
    ax.set_xlabel("µs per cycle (median; lower is better)")
    ax.tick_params(axis="y", labelsize=8)
    return None


def _throughput(ax: Any, data: Any) -> None:
    title = "2. End-to-end throughput, % of plain Task"
    if not data:
        return _missing(ax, title)
    pools = list(dict.fromkeys(s.pool for s in data))
    names = list(dict.fromkeys(s.name for s in data))
    width = 0.8 / len(names)
    palette = {
        "plain Task": "#bbbbbb",
        "SingletonTask": OURS_COLOR,
        "celery-singleton": "#8c564b",
        "celery-once": "#9467bd",
    }
    floors = iter(["#c6dbef", "#9ecae1", "#6baed6", "#3182bd", "#08519c"])
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, pool in enumerate(pools):
            plain = next(s for s in data if s.pool == pool and s.name == "plain Task")
            series = next(s for s in data if s.pool == pool and s.name == name)
            xs.append(i + (j - (len(names) - 1) / 2) * width)
            ys.append(series.vs(plain) * 100)
        color = palette.get(name) or next(floors, FLOOR_COLOR)
        ax.bar(xs, ys, width, label=_short(name), color=color)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(pools)), pools)
    ax.set_ylabel("tasks/s, % of plain (median)")
    ax.set_ylim(0, 165)
    ax.set_title(title)
    ax.legend(fontsize=6, loc="upper center", ncol=2)
    return None


def _short(name: str) -> str:
    """A legend label: a floor's name without its explanation in parentheses."""
    return name.split(" (", maxsplit=1)[0] if name.startswith("plain +") else name


def _renewal(ax: Any, data: Any) -> None:
    title = "3. Renewal: ms per interval vs locks held"
    if not data:
        return _missing(ax, title)
    locks = [r.locks for r in data]
    ax.plot(locks, [median(r.wall_ms) for r in data], "o-", color=OURS_COLOR, label="wall")
    ax.plot(locks, [median(r.cpu_ms) for r in data], "s--", color=PEER_COLOR, label="client CPU")
    ax.plot(locks, [median(r.server_ms) for r in data], "^:", color="#2ca02c", label="server")
    ax.axhline(50, color=FLOOR_COLOR, linestyle="--", linewidth=1, label="target 50 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for r in data:
        ax.annotate(
            f"{median([float(x) for x in r.round_trips]):g} RT",
            (r.locks, median(r.wall_ms)),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=8,
        )
    ax.set_xlabel("locks held by one process")
    ax.set_ylabel("ms per renewal interval (median)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return None


def _contention(ax: Any, data: Any) -> None:
    title = "4. Contention: duplicates handled per second"
    if not data:
        return _missing(ax, title)
    names = [s.name for s in data]
    values = [s.med(lambda r: r.duplicates / r.seconds) for s in data]
    colors = [OURS_COLOR if "singleton-lock" in n else PEER_COLOR for n in names]
    ax.barh(names, values, color=colors)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("duplicates/s, 50 processes on 10 keys (median; higher is better)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title)
    return None


def _beat(ax: Any, data: Any) -> None:
    title = "5. Beat: publish one scheduled run, µs"
    if not data:
        return _missing(ax, title)
    names = [n.split(" (")[0] for n in data]
    values = [median(v) for v in data.values()]
    ax.bar(names, values, color=[PEER_COLOR, OURS_COLOR])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("µs per run (median; lower is better)")
    ax.set_title(title)
    return None


def _duplicates(ax: Any, data: Any) -> None:
    title = "4b. Real worker: every delivery a duplicate"
    if not data:
        return _missing(ax, title)
    dups, series = data
    dups = [s for s in dups if s.name.startswith("SingletonTask") and "coalesce" not in s.name]
    pools = [s.pool for s in dups]
    skipped = [s.rate for s in dups]
    plain = [
        next((t.rate for t in series if t.pool == pool and t.name == "plain Task"), 0.0)
        for pool in pools
    ]
    xs = range(len(pools))
    ax.bar([x - 0.2 for x in xs], plain, 0.4, color="#bbbbbb", label="plain Task, executed")
    ax.bar([x + 0.2 for x in xs], skipped, 0.4, color=OURS_COLOR, label="SingletonTask, skipped")
    for x, (p, d) in enumerate(zip(plain, skipped, strict=True)):
        ax.text(x - 0.2, p, f"{p:.0f}", ha="center", va="bottom", fontsize=8)
        ax.text(x + 0.2, d, f"{d:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), pools)
    ax.set_ylabel("deliveries per second (median)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return None
