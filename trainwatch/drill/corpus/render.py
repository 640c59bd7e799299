"""The corpus's table for people: Markdown, so the same text reads in a terminal and goes
into docs/benchmarks.md as measured."""

from __future__ import annotations

from typing import Any

from trainwatch.drill.corpus.case import Case


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def _spread(median: float | None, span: list[float] | None, runs: int) -> str:
    """``4.5 s (3.6–13.8)`` over several runs, the median alone over one."""
    if median is None or not span or runs < 2:
        return _s(median)
    return f"{median:.1f} s ({span[0]:.1f}–{span[1]:.1f})"


def catalog(cases: list[Case]) -> str:
    lines = ["| kind | simulates | expected rank | expected cause |", "| --- | --- | --- | --- |"]
    for c in cases:
        if c.expect is None:
            lines.append(f"| {c.kind} | {c.simulates} | — | nothing reported |")
            continue
        ranks = ", ".join(map(str, c.expect.ranks)) or "none (node)"
        lines.append(f"| {c.kind} | {c.simulates} | {ranks} | "
                     f"{' or '.join(c.expect.category)}: {', '.join(c.expect.cause)} |")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    lines = ["| kind | runs | rank right | cause right | detect (median, min–max) "
             "| diagnose (median, min–max) | diagnose's first finding |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if r["clean"]:
            lines.append(f"| {r['kind']} | {r['runs']} | — | — | — | — | "
                         f"{r['false_findings']} false finding(s) |")
            continue
        said = (r["answers"][-1] if r["answers"] else "; ".join(r["errors"]) or "—")
        lines.append(f"| {r['kind']} | {r['runs']} | {r['rank_right']}/{r['runs']} | "
                     f"{r['cause_right']}/{r['runs']} | "
                     f"{_spread(r['detect_seconds'], r.get('detect_range'), r['runs'])} | "
                     f"{_spread(r['diagnose_seconds'], r.get('diagnose_range'), r['runs'])} | "
                     f"{said.replace('|', '/')} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    t, g = result["totals"], result["goals"]
    n = t["fault_runs"]
    ratio = f"{100 * t['both_right_ratio']:.0f} %" if t["both_right_ratio"] is not None else "—"
    return (f"rank and cause right in {t['both_right']}/{n} fault runs ({ratio}) over "
            f"{t['kinds']} kinds (goal >= {100 * g['right_ratio']:.0f} %: "
            f"{'met' if g['right'] else 'not met'}); detected within {g['detect_seconds']:g} s "
            f"in {t['detected_within_goal']}/{n} (median {_s(t['detect_seconds_median'])}, "
            f"slowest {_s(t.get('detect_seconds_max'))}); diagnosed within "
            f"{g['diagnose_seconds']:g} s in {t['diagnosed_within_goal']}/{n} (median "
            f"{_s(t['diagnose_seconds_median'])}, slowest {_s(t.get('diagnose_seconds_max'))}); "
            f"{t['false_findings_clean']} false "
            f"finding(s) in {t['clean_runs']} clean run(s). Goal "
            f"{'met' if g['met'] else 'not met'}." + "".join(
                f" Skipped {s['kind']}: {s['reason']}." for s in result.get("skipped") or []))
