"""The PromQL subset trainwatch rules are written in: a parser and an AST.

Rules are written once, in PromQL, so Prometheus users read exactly what runs.
The embedded engine (``alerts/evaluate.py``) evaluates the same AST in Python,
so a rule outside this subset is refused when the rules are loaded rather than
behaving differently in the two engines.

Supported: selectors with ``=``, ``!=``, ``=~``, ``!~`` matchers, ``[range]`` and ``offset``;
numbers; ``+ - * /``; comparisons (filtering, no ``bool``); ``and``, ``unless``,
``or``; ``on(...)`` and ``group_left``; aggregations ``sum avg min max count
quantile`` with ``by``; functions ``increase rate avg_over_time min_over_time
max_over_time last_over_time predict_linear time``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = ("sum", "avg", "min", "max", "count", "quantile")
RANGE_FUNCTIONS = ("increase", "rate", "avg_over_time", "min_over_time", "max_over_time",
                   "last_over_time", "predict_linear")
FUNCTIONS = RANGE_FUNCTIONS + ("time",)
COMPARISONS = (">", "<", ">=", "<=", "==", "!=")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"^(?:(\d+)(ms|s|m|h|d|w))+$")


class PromQLError(ValueError):
    """An expression outside the supported subset; ``pos`` is the character offset."""

    def __init__(self, message: str, pos: int | None = None):
        super().__init__(message)
        self.pos = pos


def parse_duration(text: str) -> float:
    """Prometheus duration (``90s``, ``5m``, ``1h30m``) in seconds; ValueError if malformed."""
    text = str(text).strip()
    if not _DURATION_RE.match(text):
        raise ValueError(f"'{text}' is not a duration like 30s, 5m or 1h30m")
    return sum(int(n) * _DURATION_UNITS[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w)", text))


def format_duration(seconds: float) -> str:
    """Seconds back to the shortest Prometheus duration (300 -> '5m')."""
    ms = int(round(seconds * 1000))
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("w", 604800000), ("d", 86400000), ("h", 3600000), ("m", 60000),
                       ("s", 1000), ("ms", 1)):
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(out)


# --------------------------------------------------------------------------- AST

@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value), op in = != =~ !~
    range: float | None = None  # seconds, for range vectors
    offset: float = 0.0


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple = ()


@dataclass(frozen=True)
class Aggregate:
    op: str
    expr: object
    by: tuple[str, ...] = ()
    param: object | None = None


@dataclass(frozen=True)
class Binary:
    op: str
    lhs: object
    rhs: object
    on: tuple[str, ...] | None = None
    group_left: bool = False


@dataclass
class Expr:
    """A parsed rule expression and the metric names it reads."""

    text: str
    root: object
    metrics: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------- lexer

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<duration>\[\s*\d+(?:ms|s|m|h|d|w)(?:\d+(?:ms|s|m|h|d|w))*\s*\])
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>>=|<=|==|!=|=~|!~|[-+*/><(){},=])
""", re.VERBOSE)


@dataclass
class _Tok:
    kind: str
    text: str
    pos: int


def _lex(text: str) -> list[_Tok]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m:
            raise PromQLError(f"unexpected character {text[pos]!r}", pos)
        if m.lastgroup != "ws":
            tokens.append(_Tok(m.lastgroup or "", m.group(), pos))
        pos = m.end()
    tokens.append(_Tok("eof", "", len(text)))
    return tokens


# --------------------------------------------------------------------------- parser

class _Parser:
    # Lowest to highest precedence, as in PromQL.
    LEVELS = (("or",), ("and", "unless"), COMPARISONS, ("+", "-"), ("*", "/"))

    def __init__(self, text: str):
        self.text = text
        self.toks = _lex(text)
        self.i = 0
        self.metrics: set[str] = set()

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def take(self, text: str | None = None, kind: str | None = None) -> _Tok:
        tok = self.tok
        if (text is not None and tok.text != text) or (kind is not None and tok.kind != kind):
            want = repr(text) if text is not None else kind
            got = repr(tok.text) if tok.text else "end of expression"
            raise PromQLError(f"expected {want}, found {got}", tok.pos)
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        if self.tok.text == text and self.tok.kind in ("op", "ident"):
            self.i += 1
            return True
        return False

    def parse(self) -> Expr:
        root = self.binary(0)
        if self.tok.kind != "eof":
            raise PromQLError(f"unexpected {self.tok.text!r}", self.tok.pos)
        return Expr(self.text, root, self.metrics)

    def binary(self, level: int) -> object:
        if level == len(self.LEVELS):
            return self.unary()
        lhs = self.binary(level + 1)
        while self.tok.text in self.LEVELS[level] and self.tok.kind in ("op", "ident"):
            op = self.take().text
            if self.tok.text == "bool":
                raise PromQLError("'bool' comparisons are not supported", self.tok.pos)
            on, group_left = self.modifiers()
            rhs = self.binary(level + 1)
            lhs = Binary(op, lhs, rhs, on, group_left)
        return lhs

    def modifiers(self) -> tuple[tuple[str, ...] | None, bool]:
        on = None
        if self.tok.text == "ignoring":
            raise PromQLError("'ignoring' is not supported; use on(...)", self.tok.pos)
        if self.accept("on"):
            on = self.label_list()
        group_left = False
        if self.accept("group_left"):
            group_left = True
            if self.tok.text == "(":
                if self.label_list():
                    raise PromQLError("group_left(labels) is not supported; use group_left()",
                                      self.tok.pos)
        if self.tok.text == "group_right":
            raise PromQLError("'group_right' is not supported", self.tok.pos)
        return on, group_left

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels = []
        while self.tok.text != ")":
            labels.append(self.take(kind="ident").text)
            if not self.accept(","):
                break
        self.take(")")
        return tuple(labels)

    def unary(self) -> object:
        if self.tok.text == "-" and self.tok.kind == "op":
            self.take()
            operand = self.unary()
            if isinstance(operand, Number):
                return Number(-operand.value)
            return Binary("*", Number(-1.0), operand)
        return self.primary()

    def primary(self) -> object:
        tok = self.tok
        if tok.kind == "number":
            self.take()
            return Number(float(tok.text))
        if tok.text == "(":
            self.take()
            inner = self.binary(0)
            self.take(")")
            return inner
        if tok.kind != "ident":
            raise PromQLError(f"unexpected {tok.text or 'end of expression'!r}", tok.pos)
        if tok.text in AGGREGATIONS:
            return self.aggregate()
        if self.toks[self.i + 1].text == "(":
            return self.call()
        return self.selector()

    def aggregate(self) -> Aggregate:
        op = self.take().text
        by: tuple[str, ...] = ()
        if self.tok.text == "without":
            raise PromQLError("'without' is not supported; use by(...)", self.tok.pos)
        if self.accept("by"):
            by = self.label_list()
        self.take("(")
        param = None
        if op == "quantile":
            param = self.binary(0)
            if not isinstance(param, Number):
                raise PromQLError("quantile needs a number first", self.tok.pos)
            self.take(",")
        inner = self.binary(0)
        self.take(")")
        if self.accept("by"):
            by = self.label_list()
        return Aggregate(op, inner, by, param)

    def call(self) -> Call:
        tok = self.take()
        if tok.text not in FUNCTIONS:
            raise PromQLError(f"function {tok.text}() is not supported "
                              f"(supported: {', '.join(FUNCTIONS)})", tok.pos)
        self.take("(")
        args = []
        while self.tok.text != ")":
            args.append(self.binary(0))
            if not self.accept(","):
                break
        self.take(")")
        want = {"time": 0, "predict_linear": 2}.get(tok.text, 1)
        if len(args) != want:
            raise PromQLError(f"{tok.text}() takes {want} argument(s)", tok.pos)
        if tok.text in RANGE_FUNCTIONS:
            if not (isinstance(args[0], Selector) and args[0].range):
                raise PromQLError(f"{tok.text}() needs a range selector like metric[5m]",
                                  tok.pos)
            if tok.text == "predict_linear" and not isinstance(args[1], Number):
                raise PromQLError("predict_linear() needs a number of seconds", tok.pos)
        return Call(tok.text, tuple(args))

    def selector(self) -> Selector:
        name = self.take(kind="ident").text
        if name in ("by", "on", "offset", "and", "or", "unless", "bool"):
            raise PromQLError(f"unexpected keyword {name!r}", self.toks[self.i - 1].pos)
        self.metrics.add(name)
        matchers = []
        if self.accept("{"):
            while self.tok.text != "}":
                label = self.take(kind="ident").text
                op_tok = self.tok
                if op_tok.text not in ("=", "!=", "=~", "!~"):
                    raise PromQLError("expected a label matcher (=, !=, =~, !~)", op_tok.pos)
                op = self.take().text
                value = self.take(kind="string").text[1:-1]
                if op in ("=~", "!~"):
                    try:
                        re.compile(value)
                    except re.error as exc:
                        raise PromQLError(f"bad regular expression {value!r}: {exc}",
                                          op_tok.pos) from None
                matchers.append((label, op, value))
                if not self.accept(","):
                    break
            self.take("}")
        rng = None
        if self.tok.kind == "duration":
            rng = parse_duration(self.take().text.strip("[] "))
        offset = 0.0
        if self.accept("offset"):
            tok = self.take(kind="ident") if self.tok.kind == "ident" else self.tok
            text = tok.text
            if tok.kind == "number":  # "5m" lexes as number 5 then ident m
                self.take()
                text += self.take(kind="ident").text
            try:
                offset = parse_duration(text)
            except ValueError as exc:
                raise PromQLError(str(exc), tok.pos) from None
        return Selector(name, tuple(matchers), rng, offset)


def parse(text: str) -> Expr:
    """Parse a rule expression; PromQLError names the offending position."""
    return _Parser(text).parse()
