"""Reports of a sweep: a compact text table, results.json and a PNG plot."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))


def level_name(level: dict[str, Any]) -> str:
    if level.get("concurrency") is None:
        return f"rate {level['request_rate']}"
    if level.get("request_rate") is not None:
        return f"c={level['concurrency']} r={level['request_rate']}"
    return f"c={level['concurrency']}"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(levels: list[dict[str, Any]]) -> str:
    """One column per level; rows are the metrics (latencies in ms)."""
    rows: list[tuple[str, list[str]]] = [
        ("completed/failed", [f"{lv['num_completed']}/{lv['num_failed']}" for lv in levels]),
        ("duration s", [_fmt(lv["duration_s"]) for lv in levels]),
        ("requests/s", [_fmt(lv["request_throughput"], 2) for lv in levels]),
        ("output tok/s", [_fmt(lv["output_throughput"]) for lv in levels]),
        ("total tok/s", [_fmt(lv["total_token_throughput"]) for lv in levels]),
        ("goodput req/s", [_fmt(lv["goodput"], 2) for lv in levels]),
    ]
    for key, label in LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} ms", [_fmt(lv[key][stat]) for lv in levels]))
    table = [("", [level_name(lv) for lv in levels]), *rows]
    width0 = max(len(label) for label, _ in table)
    widths = [max(len(cells[i]) for _, cells in table) for i in range(len(levels))]
    lines = []
    for label, cells in table:
        padded = [cell.rjust(width) for cell, width in zip(cells, widths, strict=True)]
        lines.append(" ".join([label.ljust(width0), *padded]))
    return "\n".join(lines)


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def plot_levels(path: pathlib.Path, levels: list[dict[str, Any]], title: str) -> None:
    """Throughput and latency percentiles against the load level (one tick per level)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    xs = list(range(len(levels)))
    labels = [level_name(lv) for lv in levels]
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_tput.plot(xs, [lv["output_throughput"] for lv in levels], "o-", label="output tok/s")
    ax_tput.plot(xs, [lv["total_token_throughput"] for lv in levels], "s-", label="total tok/s")
    ax_tput.set_ylabel("tokens / s")
    ax_tput.set_title("throughput")
    plotted: list[float] = []
    for (key, label), color in zip(LATENCIES, ("C0", "C1", "C2", "C3"), strict=True):
        for stat, style in (("p50", "o-"), ("p99", "x--")):
            ys = [lv[key][stat] for lv in levels]
            plotted += ys
            ax_lat.plot(xs, ys, style, color=color, label=f"{label} {stat}")
    if plotted and min(plotted) > 0:
        ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency percentiles")
    for ax in (ax_tput, ax_lat):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("load (concurrency)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
