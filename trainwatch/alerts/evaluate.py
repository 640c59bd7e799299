"""Evaluate the PromQL subset (``alerts/promql.py``) in Python, the way Prometheus does.

Semantics follow Prometheus 2.x so that the embedded engine fires at the same
moments as Prometheus (the replay tests check it against ``promtool test rules``):
instant selectors look back 5 minutes for the newest sample and honour staleness
markers; ranges are ``[t - range, t]``; ``increase``/``rate`` extrapolate like
Prometheus' ``extrapolatedRate``; vector matching, ``group_left`` and the set
operators keep the labels Prometheus keeps.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from typing import Iterable

from trainwatch.alerts.promql import Aggregate, Binary, Call, Number, Selector

LOOKBACK_SECONDS = 300.0
STALE = None  # a staleness marker in the history (the series vanished)

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, __name__ included
Vector = dict[Labels, float]


def labels_key(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class History:
    """A short, bounded sample history per series: what ranges and offsets need."""

    def __init__(self, retention_seconds: float = 3 * 3600):
        self.retention = retention_seconds
        self._series: dict[Labels, tuple[list[float], list[float | None]]] = {}

    def add(self, labels: dict[str, str] | Labels, t: float, value: float | None) -> None:
        key = labels if isinstance(labels, tuple) else labels_key(labels)
        times, values = self._series.setdefault(key, ([], []))
        if times and t <= times[-1]:
            if t == times[-1]:
                values[-1] = value
            return  # out-of-order samples are dropped, as Prometheus does
        times.append(t)
        values.append(value)

    def mark_stale(self, keep: set[Labels], t: float, name_filter=None) -> None:
        """Every series not in ``keep`` (and matching ``name_filter``) gets a staleness marker."""
        for key, (_, values) in self._series.items():
            if key not in keep and values and values[-1] is not STALE and (
                    name_filter is None or name_filter(key)):
                self.add(key, t, STALE)

    def prune(self, now: float) -> None:
        horizon = now - self.retention
        for key in list(self._series):
            times, values = self._series[key]
            cut = bisect.bisect_left(times, horizon)
            if cut:
                del times[:cut], values[:cut]
            if not times:
                del self._series[key]

    def series(self, name: str) -> Iterable[tuple[Labels, list[float], list[float | None]]]:
        for key, (times, values) in self._series.items():
            if dict(key).get("__name__") == name:
                yield key, times, values

    def __len__(self) -> int:
        return len(self._series)


class Evaluator:
    """Evaluates a parsed expression against a History at a given time."""

    def __init__(self, history: History):
        self.history = history

    def eval(self, node: object, t: float) -> Vector | float:
        method = getattr(self, "_" + type(node).__name__.lower())
        return method(node, t)

    def vector(self, node: object, t: float) -> Vector:
        result = self.eval(node, t)
        if not isinstance(result, dict):
            raise TypeError("a rule expression must produce a vector, not a number")
        return result

    # leaves ------------------------------------------------------------------
    def _number(self, node: Number, t: float) -> float:
        return node.value

    def _matches(self, node: Selector, key: Labels) -> bool:
        labels = dict(key)
        for label, op, value in node.matchers:
            have = labels.get(label, "")
            if op in ("=~", "!~"):
                # Prometheus anchors label regexes at both ends.
                if (re.fullmatch(value, have) is not None) != (op == "=~"):
                    return False
            elif (op == "=" and have != value) or (op == "!=" and have == value):
                return False
        return True

    def _selector(self, node: Selector, t: float) -> Vector:
        if node.range:
            raise TypeError("a range selector can only be a function argument")
        end = t - node.offset
        out: Vector = {}
        for key, times, values in self.history.series(node.name):
            if not self._matches(node, key):
                continue
            i = bisect.bisect_right(times, end) - 1
            if i < 0 or times[i] < end - LOOKBACK_SECONDS:
                continue
            value = values[i]
            if value is None:  # STALE: the series vanished
                continue
            out[key] = value
        return out

    def _range(self, node: Selector, t: float):
        assert node.range is not None, "the parser gives range functions range selectors only"
        end = t - node.offset
        start = end - node.range
        for key, times, values in self.history.series(node.name):
            if not self._matches(node, key):
                continue
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            points = [(times[i], values[i]) for i in range(lo, hi) if values[i] is not STALE]
            if points:
                yield _drop_name(key), points, start, end

    # functions ---------------------------------------------------------------
    def _call(self, node: Call, t: float) -> Vector | float:
        if node.func == "time":
            return t
        sel = node.args[0]
        out: Vector = {}
        for key, points, start, end in self._range(sel, t):
            value = _RANGE_FUNCS[node.func](points, start, end, sel.range, t,
                                            node.args[1].value if len(node.args) > 1 else None)
            if value is not None:
                out[key] = value
        return out

    # aggregations ------------------------------------------------------------
    def _aggregate(self, node: Aggregate, t: float) -> Vector:
        groups: dict[Labels, list[float]] = defaultdict(list)
        for key, value in self.vector(node.expr, t).items():
            labels = dict(key)
            groups[tuple((k, labels[k]) for k in sorted(node.by) if k in labels)].append(value)
        out: Vector = {}
        for key, values in groups.items():
            if node.op == "sum":
                out[key] = math.fsum(values)
            elif node.op == "avg":
                out[key] = math.fsum(values) / len(values)
            elif node.op == "min":
                out[key] = min(values, key=lambda v: (math.isnan(v), v))
            elif node.op == "max":
                out[key] = max(values, key=lambda v: (not math.isnan(v), v))
            elif node.op == "count":
                out[key] = float(len(values))
            elif node.op == "quantile":
                assert isinstance(node.param, Number), "the parser gives quantile a number"
                out[key] = _quantile(node.param.value, values)
        return out

    # binary operators ----------------------------------------------------------
    def _binary(self, node: Binary, t: float) -> Vector | float:
        lhs, rhs = self.eval(node.lhs, t), self.eval(node.rhs, t)
        op = node.op
        if op in ("and", "unless", "or"):
            return _set_op(op, lhs, rhs, node.on)
        if isinstance(lhs, dict):
            if isinstance(rhs, dict):
                return _vector_op(op, lhs, rhs, node.on, node.group_left)
            return _vector_scalar_op(op, lhs, rhs, scalar_left=False)
        if isinstance(rhs, dict):
            return _vector_scalar_op(op, rhs, lhs, scalar_left=True)
        return _scalar_op(op, lhs, rhs)[0]


# --------------------------------------------------------------------------- helpers

def _drop_name(key: Labels) -> Labels:
    return tuple(p for p in key if p[0] != "__name__")


def _signature(key: Labels, on: tuple[str, ...] | None) -> Labels:
    if on is None:
        return _drop_name(key)
    return tuple(p for p in key if p[0] in on)


def _scalar_op(op: str, a: float, b: float) -> tuple[float, bool]:
    if op == "+":
        return a + b, True
    if op == "-":
        return a - b, True
    if op == "*":
        return a * b, True
    if op == "/":
        if b == 0:
            return (math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) *
                    math.copysign(1, b)), True
        return a / b, True
    keep = {">": a > b, "<": a < b, ">=": a >= b, "<=": a <= b, "==": a == b,
            "!=": a != b}[op]
    return a, keep


def _vector_scalar_op(op: str, vec: Vector, scalar: float, scalar_left: bool) -> Vector:
    comparison = op in ("<", ">", "<=", ">=", "==", "!=")
    out: Vector = {}
    for key, v in vec.items():
        a, b = (scalar, v) if scalar_left else (v, scalar)
        value, keep = _scalar_op(op, a, b)
        if comparison:
            value = v  # the vector's value is kept, whichever side it is on
        if keep:
            out[key if comparison else _drop_name(key)] = value
    return out


def _vector_op(op: str, lhs: Vector, rhs: Vector, on: tuple[str, ...] | None,
               group_left: bool) -> Vector:
    right: dict[Labels, tuple[Labels, float]] = {}
    for key, v in rhs.items():
        sig = _signature(key, on)
        if sig in right:
            raise ValueError("many-to-many matching: the right side has duplicate series "
                             f"for {dict(sig)}")
        right[sig] = (key, v)
    out: Vector = {}
    seen: set[Labels] = set()
    comparison = op in ("<", ">", "<=", ">=", "==", "!=")
    for key, lv in lhs.items():
        sig = _signature(key, on)
        if sig not in right:
            continue
        if not group_left:
            if sig in seen:
                raise ValueError("many-to-one matching needs group_left "
                                 f"(duplicate left series for {dict(sig)})")
            seen.add(sig)
        value, keep = _scalar_op(op, lv, right[sig][1])
        if not keep:
            continue
        labels = key if comparison else _drop_name(key)
        if not group_left:
            labels = (tuple(p for p in labels if p[0] in on or p[0] == "__name__")
                      if on is not None else labels)
        out[labels] = value
    return out


def _set_op(op: str, lhs, rhs, on: tuple[str, ...] | None) -> Vector:
    if not (isinstance(lhs, dict) and isinstance(rhs, dict)):
        raise TypeError(f"'{op}' needs vectors on both sides")
    rsigs = {_signature(k, on) for k in rhs}
    if op == "and":
        return {k: v for k, v in lhs.items() if _signature(k, on) in rsigs}
    if op == "unless":
        return {k: v for k, v in lhs.items() if _signature(k, on) not in rsigs}
    lsigs = {_signature(k, on) for k in lhs}
    out = dict(lhs)
    out.update({k: v for k, v in rhs.items() if _signature(k, on) not in lsigs})
    return out


def _quantile(q: float, values: list[float]) -> float:
    if math.isnan(q) or not values:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lower = max(0, math.floor(rank))
    upper = min(len(ordered) - 1, lower + 1)
    weight = rank - math.floor(rank)
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


def _extrapolated_rate(points, start, end, range_s, is_rate):
    """Prometheus' extrapolatedRate for counters (increase/rate)."""
    if len(points) < 2:
        return None
    first_t, first_v = points[0]
    last_t, last_v = points[-1]
    result = last_v - first_v
    previous = 0.0
    for _, v in points:  # counter resets: add back what was there before the reset
        if v < previous:
            result += previous
        previous = v
    to_start = first_t - start
    to_end = end - last_t
    sampled = last_t - first_t
    average_gap = sampled / (len(points) - 1)
    if result > 0 and first_v >= 0:
        to_zero = sampled * (first_v / result)
        to_start = min(to_start, to_zero)
    threshold = average_gap * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average_gap / 2
    interval += to_end if to_end < threshold else average_gap / 2
    result *= interval / sampled
    return result / range_s if is_rate else result


def _predict_linear(points, t, horizon):
    if len(points) < 2:
        return None
    n = sum_x = sum_y = sum_xy = sum_x2 = 0.0
    for pt, v in points:
        x = pt - t
        n += 1
        sum_x += x
        sum_y += v
        sum_xy += x * v
        sum_x2 += x * x
    var_x = sum_x2 - sum_x * sum_x / n
    if var_x == 0:
        return None
    slope = (sum_xy - sum_x * sum_y / n) / var_x
    intercept = sum_y / n - slope * sum_x / n
    return intercept + slope * horizon


def _avg(values: list[float]) -> float:
    return math.fsum(values) / len(values)


_RANGE_FUNCS = {
    "increase": lambda p, s, e, r, t, a: _extrapolated_rate(p, s, e, r, False),
    "rate": lambda p, s, e, r, t, a: _extrapolated_rate(p, s, e, r, True),
    "avg_over_time": lambda p, s, e, r, t, a: _avg([v for _, v in p]),
    "min_over_time": lambda p, s, e, r, t, a: min(v for _, v in p),
    "max_over_time": lambda p, s, e, r, t, a: max(v for _, v in p),
    # the newest sample in the range: what a series said last before it vanished
    "last_over_time": lambda p, s, e, r, t, a: p[-1][1],
    "predict_linear": lambda p, s, e, r, t, a: _predict_linear(p, t, a),
}
