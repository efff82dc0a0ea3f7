"""summary.md for `make bench`: the numbers a reader wants first, as Markdown tables."""

from __future__ import annotations

import pathlib
from typing import Any

from bench.report import level_name as _level_name


def _num(value: Any, digits: int = 1) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int | float):
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return str(value)


def _scalars(result: Any, limit: int = 8) -> str:
    """The first few scalar entries of a micro-benchmark's dict, flattened one level."""
    if not isinstance(result, dict):
        return ""
    items: list[str] = []
    for key, value in result.items():
        if isinstance(value, dict):
            items += [f"{key}.{k}={_num(v, 3)}" for k, v in value.items() if _is_scalar(v)]
        elif _is_scalar(value):
            items.append(f"{key}={_num(value, 3)}")
    more = " ..." if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _is_scalar(value: Any) -> bool:
    return isinstance(value, int | float | str | bool) or value is None


def _micro_section(micro: dict[str, Any]) -> list[str]:
    lines = ["## Micro-benchmarks", "", "| benchmark | status | seconds | results |"]
    lines.append("|---|---|---|---|")
    for name, entry in micro.items():
        detail = entry.get("error") or _scalars(entry.get("result"))
        lines.append(f"| {name} | {entry['status']} | {_num(entry.get('seconds'))} | {detail} |")
    return lines


def _level_row(label: str, lv: dict[str, Any]) -> str:
    cells = [
        label,
        f"{lv['num_completed']}/{lv['num_failed']}",
        _num(lv["request_throughput"], 2),
        _num(lv["output_throughput"]),
        _num(lv["total_token_throughput"]),
        f"{_num(lv['ttft_ms']['p50'])} / {_num(lv['ttft_ms']['p99'])}",
        f"{_num(lv['tpot_ms']['p50'])} / {_num(lv['tpot_ms']['p99'])}",
        _num(lv["itl_ms"]["p50"]),
        f"{_num(lv['e2el_ms']['p50'])} / {_num(lv['e2el_ms']['p99'])}",
    ]
    return "| " + " | ".join(cells) + " |"


LEVEL_HEADER = [
    "| {first} | done/failed | req/s | out tok/s | total tok/s | TTFT p50/p99 ms "
    "| TPOT p50/p99 ms | ITL p50 ms | E2EL p50/p99 ms |",
    "|---|---|---|---|---|---|---|---|---|",
]


def _failures(levels: list[dict[str, Any]]) -> list[str]:
    notes = [
        f"{_level_name(lv)}: {lv['num_failed']} failed ({'; '.join(lv['errors'])})"
        for lv in levels
        if lv["num_failed"]
    ]
    return ["", "Failures: " + ", ".join(notes) + "."] if notes else []


def _ratio(a: Any, b: Any) -> str:
    if isinstance(a, int | float) and isinstance(b, int | float) and b > 0:
        return f"{a / b:.2f}x"
    return "-"


def _stat(level: dict[str, Any] | None, metric: str) -> Any:
    return None if level is None else level[metric]["p50"]


def _llamacpp_section(serving: dict[str, Any]) -> list[str]:
    """cellserve's sweep next to llama.cpp's, level by level (same prompts, same seeds)."""
    llama = serving["llamacpp"]
    lines = ["## Side by side with llama.cpp (same GGUF, same prompts)", ""]
    if "error" in llama:
        return [*lines, f"**llama.cpp error:** {llama['error']}", ""]
    ours = {lv["concurrency"]: lv for lv in serving.get("sweep", {}).get("levels", [])}
    theirs = {lv["concurrency"]: lv for lv in llama["sweep"]["levels"]}
    lines += [
        "| concurrency | cellserve out tok/s | llama.cpp out tok/s | cellserve / llama.cpp "
        "| TTFT p50 ms (cellserve / llama.cpp) | ITL p50 ms (cellserve / llama.cpp) |",
        "|---|---|---|---|---|---|",
    ]
    for c in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(c), theirs.get(c)
        tps_a = None if a is None else a["output_throughput"]
        tps_b = None if b is None else b["output_throughput"]
        cells = [
            str(c),
            _num(tps_a),
            _num(tps_b),
            _ratio(tps_a, tps_b),
            f"{_num(_stat(a, 'ttft_ms'))} / {_num(_stat(b, 'ttft_ms'))}",
            f"{_num(_stat(a, 'itl_ms'))} / {_num(_stat(b, 'itl_ms'))}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _failures(llama["sweep"]["levels"])
    if llama["sweep"].get("skipped_levels"):
        lines += [
            "",
            f"llama.cpp skipped for time: concurrency {llama['sweep']['skipped_levels']}.",
        ]
    lines += ["", "cellserve:", "", "```", " ".join(serving.get("command", ["?"])), "```", ""]
    lines += ["llama.cpp:", "", "```", " ".join(llama["command"]), "```", ""]
    return lines


def _rss(report: dict[str, Any]) -> str:
    """Resident memory after start and its peak over the sweep: a server that touches its KV
    pages (or state slots) only when it writes them looks small at start; the peak is what the
    load made resident."""
    rss, peak = report.get("rss_after_start"), report.get("rss_peak")
    out = "" if not rss else f", RSS {rss / 2**30:.2f} GiB after start"
    return out + ("" if not peak else f", {peak / 2**30:.2f} GiB at its peak over the load")


def _serving_section(serving: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "startup_s" in serving:
        lines += [f"cellserve became healthy in {serving['startup_s']:.1f} s{_rss(serving)}.", ""]
    llama = serving.get("llamacpp") or {}
    if "startup_s" in llama:
        lines += [f"llama.cpp became healthy in {llama['startup_s']:.1f} s{_rss(llama)}.", ""]
    if "command" in serving and "llamacpp" not in serving:
        lines += [f"cellserve: `{' '.join(serving['command'])}`", ""]
    sweep = serving.get("sweep")
    if sweep:
        w = sweep["workload"]
        lines += [
            f"## Serving sweep: random prompts, input {w['input_len']}, output {w['output_len']}",
            "",
            f"Model {sweep['model']}; prompt lengths {sweep['prompt_lengths']}; "
            "client-side timings (`bench/loadgen.py`).",
            "",
            LEVEL_HEADER[0].format(first="concurrency"),
            LEVEL_HEADER[1],
        ]
        lines += [_level_row(str(lv["concurrency"]), lv) for lv in sweep["levels"]]
        lines += _failures(sweep["levels"])
        if sweep.get("skipped_levels"):
            lines += ["", f"Skipped for time: concurrency {sweep['skipped_levels']}."]
        lines.append("")
    if "llamacpp" in serving:
        lines += _llamacpp_section(serving)
    if "prefix_on" in serving:
        w = serving["prefix_on"]["workload"]
        lines += [
            f"## Shared prefix: {w['prefix_len']}-token system prompt + {w['input_len']}-token "
            f"suffix, output {w['output_len']}",
            "",
            LEVEL_HEADER[0].format(first="prefix cache"),
            LEVEL_HEADER[1],
            _level_row("on", serving["prefix_on"]["levels"][0]),
        ]
        if "prefix_off" in serving:
            lines.append(_level_row("off", serving["prefix_off"]["levels"][0]))
        lines += _failures(
            [serving[k]["levels"][0] for k in ("prefix_on", "prefix_off") if k in serving]
        )
        ratio = serving.get("prefix_ttft_ratio")
        if ratio:
            lines += [
                "",
                f"TTFT without / with the prefix cache: mean {_num(ratio['mean'], 2)}x, "
                f"p50 {_num(ratio['p50'], 2)}x, p99 {_num(ratio['p99'], 2)}x.",
            ]
        lines.append("")
    if "error" in serving:
        lines += [f"**Serving error:** {serving['error']}", ""]
    return lines


def render_summary(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    lines = [
        "# cellserve benchmark",
        "",
        f"{env.get('date')}, commit {env.get('commit')}, Python {env.get('python')}, "
        f"{env.get('cpu_count')} CPUs ({env.get('machine')}).",
        "",
    ]
    if report.get("micro"):
        lines += [*_micro_section(report["micro"]), ""]
    if "serving" in report:
        lines += _serving_section(report["serving"])
        lines += _bandwidth_lines(report)
    return "\n".join(lines).rstrip() + "\n"


def _bandwidth_lines(report: dict[str, Any]) -> list[str]:
    """The c=1 decode's achieved read bandwidth (the bytes a decode token reads over its ITL
    p50) beside the machine's (bench/bandwidth_bench.py)."""
    serving = report["serving"]
    read = serving.get("decode_read_bytes")
    micro = report.get("micro", {}).get("bandwidth_bench", {})
    machine = micro.get("result", {}).get("read_gbps") if micro.get("status") == "ok" else None
    if not read:
        return []
    lines = []
    for who, part in (("cellserve", serving), ("llama.cpp", serving.get("llamacpp") or {})):
        levels = (part.get("sweep") or {}).get("levels", [])
        levels = [lv for lv in levels if lv["concurrency"] == 1]
        itl = levels[0]["itl_ms"]["p50"] if levels else None
        if not itl:
            continue
        gbps = read / (itl / 1000) / 1e9
        share = ""
        if machine:
            share = f" ({100 * gbps / machine:.0f}% of the measured {machine:.1f} GB/s)"
        lines.append(
            f"{who} c=1: a decode token reads {read / 1e9:.2f} GB of weights in {itl:.1f} ms "
            f"(ITL p50): {gbps:.1f} GB/s{share}."
        )
    return [*lines, ""] if lines else []


def write_summary(path: pathlib.Path, report: dict[str, Any]) -> str:
    text = render_summary(report)
    path.write_text(text)
    return text
