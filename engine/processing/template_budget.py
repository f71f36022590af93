"""The budget a caller's chat template renders under: jinja2's immutable sandbox with every
hook counted (`BudgetedEnvironment`), and the limits it counts against (`RenderBudget`).

jinja2's sandbox stops attribute escapes, not work: three nested `range(100000)` loops are
10^15 iterations, `'x' * 10**9` is a gigabyte, a macro that calls itself twice is a binary tree.
In `BudgetedEnvironment` every render runs inside `counting(budget)` and stops with
`TemplateBudgetError` as soon as one count passes its limit:

- steps: loop iterations (every `for`, recursive ones too), calls (functions, methods, filters,
  tests; a macro counts `MACRO_STEPS`), attribute and item lookups, operators, comparisons and
  printed values, plus one per `CHARS_PER_STEP` characters a comparison or a string method scans
  and one per `ITEMS_PER_STEP` items a filter walks: the render's work, a step about a
  microsecond;
- size: no value may weigh more than `max_size` characters (a string its length, a container
  its items, a shared item each time it appears: `[[s] * 1000] * 1000` weighs a million `s`).
  The operations that can multiply their inputs (`*`, `**`, `%`, `~`, `+`, `str.format`, padding,
  `replace`, `join`, the width arguments of filters) are checked before they run, the others
  after, so nothing much heavier than the limit is ever built;
- produced: the characters all operations make together; output: the rendered text's;
- depth: calls in progress (macro recursion).

A thread cannot be killed: these counters, checked at every step, are what end a render, within
about a second of CPU at the defaults. `RenderBudget.scaled_to` grows the sizes with what the
caller sent (a template that echoes a long chat is not refused) and the steps with its values,
up to 8x the floor.

How the counting attaches: the sandbox already routes calls, attribute and item lookups and the
listed binary operators through environment methods (overridden here), and the filters and tests
are wrapped when the environment is built. Loops, `~`, comparisons and literals jinja2 compiles
inline, so the parsed template is rewritten before code generation (`_Rewrite`): each `for`
iterates `triollm:iter(...)`, each `a ~ b` is `triollm:concat(a, b)`, each comparison
`triollm:compare(...)`, each list, tuple or dict literal `triollm:value(...)`: filters whose names
no template can write (a colon), so none can call or shadow them. A namespace, the one object a
template can change after sharing it, prints as a constant, so it cannot grow a value behind the
size check. `lipsum` is gone (its loops are out of the counters' sight), and there is no loader:
`{% include %}` reads nothing.

Rejected: a wall-clock timeout around the render (vLLM's): the thread keeps running, and
allocating, after the timeout has answered. A subprocess per render: killable, but milliseconds
of IPC per request. `sys.settrace` counting lines: slows every frame of the thread and displaces
coverage tools. An allow-list of template constructs: breaks real templates. What is not
charged: the work inside one builtin beyond its inputs' size (a sort's comparisons), and
compiling, which `max_source` bounds.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
import string
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence, ValuesView
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.runtime import Context, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

__all__ = ["BudgetedEnvironment", "RenderBudget", "RenderCounters", "TemplateBudgetError", "counting"]

CHARS_PER_STEP = 1024  # characters a comparison or a string method scans per step
ITEMS_PER_STEP = 64  # items a filter walks per step
MACRO_STEPS = 4  # a macro call (arguments bound, a frame, a buffer) costs a few microseconds
_MAX_INT_BITS = 14_000  # about Python's 4300-digit limit on printing an int
_MAX_NESTING = 100  # containers in containers, for the weight's walk


@dataclass(frozen=True)
class RenderBudget:
    """What one render of a caller's template may do (floors: `scaled_to` adds the chat's share)."""

    max_steps: int = 500_000  # loop iterations, calls, lookups, operators (see the module doc)
    max_size: int = 1 << 20  # characters in any one value
    max_produced: int = 64 << 20  # characters made by all operations together
    max_output: int = 4 << 20  # characters of the rendered text
    max_depth: int = 64  # calls in progress
    max_source: int = 256 << 10  # characters of the template itself

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name}: must be a positive integer, got {value!r}")

    def scaled_to(self, context: Mapping[str, Any]) -> RenderBudget:
        """The limits for rendering `context`: sizes grow by the characters of its strings, steps
        by 32 a value (up to 8x the floor)."""
        chars, values = _measure(context)
        return replace(
            self,
            max_steps=min(8 * self.max_steps, self.max_steps + 32 * values),
            max_size=self.max_size + chars,
            max_produced=self.max_produced + 4 * chars,
            max_output=self.max_output + 2 * chars,
        )


class TemplateBudgetError(jinja2.TemplateRuntimeError):
    """A caller's template went over its `RenderBudget`; the message names the limit."""


# ---------------------------------------------------------------------------------------------
# the counters of one render


class RenderCounters:
    """One render's counts against its budget; `weight` memoizes containers by identity (the
    sandbox's lists and dicts cannot change, and the memo holds them, so ids stay theirs)."""

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.produced = 0
        self.output = 0
        self.depth = 0
        self._weights: dict[int, tuple[object, int]] = {}

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.budget.max_steps:
            raise TemplateBudgetError(
                f"more than {self.budget.max_steps} steps (loop iterations, calls, lookups, operators)"
            )

    def fits(self, size: int, what: str) -> None:
        if size > self.budget.max_size:
            raise TemplateBudgetError(
                f"{what} would make a value of {size} characters, over the limit of {self.budget.max_size}"
            )

    def made(self, value: Any, what: str, new: bool = True) -> Any:
        """`value` checked against the size limit (and, when `new`, counted as produced)."""
        size = self.weight(value)
        self.fits(size, what)
        if new:
            self.make(len(value) if isinstance(value, list | tuple | dict) else size)
        return value

    def make(self, chars: int) -> None:
        self.produced += chars
        if self.produced > self.budget.max_produced:
            raise TemplateBudgetError(f"more than {self.budget.max_produced} characters produced")

    def emit(self, chars: int) -> None:
        self.output += chars
        if self.output > self.budget.max_output:
            raise TemplateBudgetError(f"a rendered text of more than {self.budget.max_output} characters")

    def weight(self, value: object) -> int:
        """About the length of `str(value)` (of its JSON, for containers), counted no further
        than just past `max_size`."""
        if isinstance(value, str):
            return len(value)
        if isinstance(value, _CONTAINERS):
            return self._weigh(value, 0)
        return _scalar_weight(value)

    def _weigh(self, value: Any, depth: int) -> int:
        known = self._weights.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if depth > _MAX_NESTING:
            raise TemplateBudgetError(f"values nested more than {_MAX_NESTING} deep")
        limit = self.budget.max_size
        items = value.mapping if isinstance(value, _VIEWS) else value  # type: ignore[union-attr]
        total = 2 + 4 * len(items)
        if total > limit:
            return total
        for item in itertools.chain.from_iterable(items.items()) if isinstance(items, dict) else items:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, _CONTAINERS):
                total += self._weigh(item, depth + 1)
            else:
                total += _scalar_weight(item)
            if total > limit:
                return total
        self._weights[id(value)] = (value, total)
        return total


_VIEWS = (KeysView, ValuesView, ItemsView)  # dict views: weighed as their dict
_CONTAINERS = (list, tuple, dict, set, frozenset, *_VIEWS)


def _scalar_weight(value: object) -> int:
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, bytes):
        return 4 * len(value) + 3
    return 32


_ACTIVE: ContextVar[RenderCounters | None] = ContextVar("triollm_template_budget", default=None)


@contextmanager
def counting(budget: RenderBudget) -> Iterator[RenderCounters]:
    """The counters every `BudgetedEnvironment` hook charges while the block runs (in this
    thread or task: a context variable). Compile a caller's template inside it too: jinja2 folds
    constants at compile time through the same hooks."""
    token = _ACTIVE.set(RenderCounters(budget))
    try:
        yield _active()
    finally:
        _ACTIVE.reset(token)


def _active() -> RenderCounters:
    counters = _ACTIVE.get()
    if counters is None:  # compile-time folding outside `counting`: the node stays unfolded
        raise TemplateBudgetError("a caller's template runs only inside counting()")
    return counters


def _measure(value: object) -> tuple[int, int]:
    """The characters of the strings in a JSON-like value, and its number of values."""
    chars, count, stack = 0, 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return chars, count


# ---------------------------------------------------------------------------------------------
# checks before an operation that can multiply its inputs


def _int_arg(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default


def _repeat(c: RenderCounters, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise TemplateBudgetError(f"a product of more than {_MAX_INT_BITS} bits")
        return
    seq, times = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(seq, str | bytes | list | tuple) and isinstance(times, int):
        c.fits(c.weight(seq) * max(times, 0), "'*'")


def _power(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if math.log2(abs(left)) * right > _MAX_INT_BITS:
            raise TemplateBudgetError(f"a power of more than {_MAX_INT_BITS} bits")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")


def _largest(c: RenderCounters, args: Any) -> int:
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    return max((c.weight(v) for v in values), default=0)


def _percent(c: RenderCounters, fmt: str, args: Any) -> None:
    """`fmt % args`: its widths, plus the heaviest argument in every field."""
    specs = _PERCENT_SPEC.findall(fmt)
    if any("*" in spec for spec in specs):
        raise TemplateBudgetError("'*' widths in a % format")
    widths = sum(int(n or 0) for spec in specs for n in spec)
    c.fits(len(fmt) + widths + len(specs) * _largest(c, args), "a % format")


def _format(c: RenderCounters, fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """`fmt.format(...)`: its widths, plus the heaviest argument in every field."""
    fields_, widths = 0, 0
    for _, name, spec, _ in string.Formatter().parse(fmt):
        if name is None:
            continue
        if spec and "{" in spec:
            raise TemplateBudgetError("nested fields in a format spec")
        fields_ += 1
        widths += sum(int(n) for n in _DIGITS.findall(spec or ""))
    heaviest = max(_largest(c, args), _largest(c, dict(kwargs)))
    c.fits(len(fmt) + widths + fields_ * heaviest, "str.format")


def _replace(c: RenderCounters, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if all(isinstance(x, str | bytes) for x in (s, old, new)):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        c.fits(len(s) + hits * max(len(new) - len(old), 0), "replace")


def _collect(c: RenderCounters, items: Iterable[Any], separator: Any, what: str) -> list[Any]:
    """`items` as a list, stopping as soon as joining them with `separator` would be too big."""
    out: list[Any] = []
    size, gap = 0, len(separator) if isinstance(separator, str | bytes) else 0
    for item in items:
        size += c.weight(item) + gap
        c.fits(size, what)
        out.append(item)
    c.step(len(out) // ITEMS_PER_STEP)
    return out


def _str_method(c: RenderCounters, method: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Checks before a str/bytes method runs; the arguments to call it with."""
    s, name = method.__self__, method.__name__
    c.step(len(s) // CHARS_PER_STEP)
    if name in ("center", "ljust", "rjust", "zfill") and args:
        c.fits(_int_arg(args[0]), name)
    elif name == "expandtabs":
        c.fits(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _int_arg((args or (8,))[0], 8), name)
    elif name == "replace" and len(args) >= 2:
        _replace(c, s, *args[:3])
    elif name == "join" and args:
        return (_collect(c, args[0], s, "join"), *args[1:])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((c.weight(v) for v in args[0].values()), default=1)
        c.fits(len(s) * max(longest, 1), "translate")
    return args


# The filters whose arguments can multiply their input: checks before they run (arguments after
# the value; `None` where nothing needs changing).
def _center(c: RenderCounters, value: Any, width: Any = 80) -> None:
    c.fits(c.weight(value) + _int_arg(width), "center")


def _indent(c: RenderCounters, value: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    pad = _int_arg(width) if not isinstance(width, str) else len(width)
    lines = value.count("\n") + 1 if isinstance(value, str) else c.weight(value)
    c.fits(c.weight(value) + lines * pad, "indent")


def _wordwrap(c: RenderCounters, value: Any, width: Any = 79, *args: Any, **kwargs: Any) -> None:
    wrap = kwargs.get("wrapstring", args[1] if len(args) > 1 else None)
    breaks = c.weight(value) // max(_int_arg(width, 1), 1) + 1
    c.fits(c.weight(value) + breaks * (len(wrap) if isinstance(wrap, str) else 1), "wordwrap")


def _batch(c: RenderCounters, value: Any, count: Any, *_: Any, **__: Any) -> None:
    c.fits(_int_arg(count), "batch")


def _slice(c: RenderCounters, value: Any, count: Any, *_: Any, **__: Any) -> None:
    c.fits(_int_arg(count), "slice")
    c.step(_int_arg(count) // ITEMS_PER_STEP)


def _tojson_check(c: RenderCounters, value: Any, *args: Any, **kwargs: Any) -> None:
    indent = max((_int_arg(a) for a in (*args, kwargs.get("indent"))), default=0)  # whatever its place
    c.fits(c.weight(value) * (1 + max(indent, 0)), "tojson")


def _format_filter(c: RenderCounters, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _percent(c, value, kwargs or args)


def _replace_filter(c: RenderCounters, value: Any, old: Any = "", new: Any = "", count: Any = None) -> None:
    _replace(c, value, old, new, -1 if count is None else count)


_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "batch": _batch,
    "slice": _slice,
    "tojson": _tojson_check,
    "format": _format_filter,
    "replace": _replace_filter,
}
# Filters that look at one item (or none) of their value: one step, whatever its size.
_CONSTANT_FILTERS = frozenset({"length", "count", "first", "last", "default", "d", "attr", "safe", "random"})
# Tests that compare their value with their argument: charged by what they scan.
_COMPARING_TESTS = frozenset(
    {"in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">="}
)


def _counted_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment first
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        c = _active()
        value: Any = args[skip] if len(args) > skip else None
        c.step(1 if name in _CONSTANT_FILTERS else 1 + _walk_steps(value))
        if name == "join" and len(args) > skip:
            gap = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            args = (*args[:skip], _collect(c, value, gap, name), *args[skip + 1 :])
        elif name == "sum" and len(args) > skip:
            items = _collect(c, value, "", name)
            start = kwargs.get("start", args[skip + 2] if len(args) > skip + 2 else 0)
            if not isinstance(start, int | float):  # sequences: each addition copies the total
                c.step(len(items) * c.weight(items) // CHARS_PER_STEP)
            args = (*args[:skip], items, *args[skip + 1 :])
        elif check is not None and len(args) > skip:
            check(c, *args[skip:], **kwargs)
        return c.made(fn(*args, **kwargs), f"the filter {name!r}")

    return counted


def _counted_test(name: str, fn: Any) -> Callable[..., Any]:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        c = _active()
        scanned = sum(c.weight(a) for a in args[skip:]) if name in _COMPARING_TESTS else 0
        c.step(1 + scanned // CHARS_PER_STEP)
        return fn(*args, **kwargs)

    return counted


def _walk_steps(value: Any) -> int:
    """The steps of walking `value` once: its characters or its items."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_STEP
    return len(value) // ITEMS_PER_STEP if isinstance(value, list | tuple | dict) else 0


# ---------------------------------------------------------------------------------------------
# the rewritten constructs


class _Counted:
    """An iterable counted one step an item; sized when its source is (so `loop.length` does
    not list it)."""

    __slots__ = ("_counters", "_it", "_source")

    def __init__(self, source: Any, counters: RenderCounters) -> None:
        self._source, self._it, self._counters = source, iter(source), counters

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._counters.step()
        return item

    def __len__(self) -> int:
        return len(self._source)


def _iter(value: Any) -> _Counted:
    return _Counted(value, _active())


def _concat(*parts: Any) -> str:
    c = _active()
    c.step()
    size = sum(c.weight(p) for p in parts)
    c.fits(size, "'~'")
    c.make(size)
    return "".join([str(p) for p in parts])


_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


def _compare(left: Any, op: str, right: Any) -> Any:
    c = _active()
    scanned = c.weight(right) if op in ("in", "notin") else min(c.weight(left), c.weight(right))
    c.step(1 + scanned // CHARS_PER_STEP)
    return _COMPARE[op](left, right)


def _charge(value: Any) -> Any:
    c = _active()
    c.step(1 + c.weight(value) // CHARS_PER_STEP)
    return value


def _value(value: Any) -> Any:
    c = _active()
    c.step()
    return c.made(value, "a literal")


_ITER, _CONCAT, _CMP = "triollm:iter", "triollm:concat", "triollm:compare"
_CHARGE, _VALUE = "triollm:charge", "triollm:value"


def _wrap(node: nodes.Node, name: str, args: Sequence[nodes.Node] = ()) -> nodes.Filter:
    return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)


class _Rewrite(NodeTransformer):
    """Routes the constructs jinja2 compiles inline through the counting filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _wrap(node.iter, _ITER)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _wrap(node.nodes[0], _CONCAT, node.nodes[1:])

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        if len(node.ops) == 1:
            [op] = node.ops
            return _wrap(node.expr, _CMP, [nodes.Const(op.op, lineno=node.lineno), op.expr])
        node.expr = _wrap(node.expr, _CHARGE)
        for op in node.ops:
            op.expr = _wrap(op.expr, _CHARGE)
        return node

    def _literal(self, node: nodes.List | nodes.Tuple | nodes.Dict) -> nodes.Node:
        self.generic_visit(node)
        return node if getattr(node, "ctx", "load") != "load" else _wrap(node, _VALUE)

    visit_List = visit_Tuple = visit_Dict = _literal


# ---------------------------------------------------------------------------------------------
# the environment


class _QuietNamespace(Namespace):
    """`namespace()` whose `str()` is a constant: its attributes can change after a list holds
    it, so they must not count towards what printing the list makes."""

    def __repr__(self) -> str:
        return "<Namespace>"


def _finalize(value: Any) -> Any:
    c = _active()
    c.step()
    if not isinstance(value, str):
        c.made(value, "printing a value")
    return value


def _join_buffer(parts: Iterable[str]) -> str:
    """The environment's `concat` (macro bodies, `{% set %}` blocks, `{% filter %}`), checked first."""
    c = _active()
    parts = parts if isinstance(parts, list) else list(parts)
    size = sum(map(len, parts))
    c.fits(size, "a block")
    c.make(size)
    return "".join(parts)


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every hook counted against the active `counting()`
    block. `globals` and `filters` are added before the filters are wrapped, so they are counted
    too; render (and compile) only inside `counting()`."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    concat = staticmethod(_join_buffer)  # type: ignore[assignment]

    def __init__(
        self,
        *,
        globals: Mapping[str, Any] | None = None,  # jinja2's word for them
        filters: Mapping[str, Callable[..., Any]] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(finalize=_finalize, **options)
        self.globals.update(globals or {})
        self.globals["namespace"] = _QuietNamespace
        del self.globals["lipsum"]  # its loops are Python's, out of the counters' sight
        counted = {**self.filters, **(filters or {})}
        self.filters = {name: _counted_filter(name, fn) for name, fn in counted.items()}
        self.tests = {name: _counted_test(name, fn) for name, fn in self.tests.items()}
        self.filters.update({_ITER: _iter, _CONCAT: _concat, _CMP: _compare, _CHARGE: _charge, _VALUE: _value})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Rewrite().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree  # type: ignore[no-any-return]

    def getattr(self, obj: Any, attribute: str) -> Any:
        _active().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _active().step()
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        c = _active()
        c.step()
        if operator == "*":
            _repeat(c, left, right)
        elif operator == "**":
            _power(left, right)
        elif operator == "+" and isinstance(left, str | bytes | list | tuple):
            c.fits(c.weight(left) + c.weight(right), "'+'")
        elif operator == "%" and isinstance(left, str | bytes):
            _percent(c, left if isinstance(left, str) else left.decode("latin-1"), right)
        return c.made(self.binop_table[operator](left, right), f"{operator!r}")

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        c = _active()
        c.step(MACRO_STEPS if isinstance(obj, Macro) else 1)
        new = False
        if isinstance(obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (_Counted(args[0], c), *args[1:])
        elif isinstance(obj, types.BuiltinMethodType) and isinstance(obj.__self__, str | bytes):
            args, new = _str_method(c, obj, args), True
        elif getattr(obj, "__name__", None) in ("format", "format_map") and hasattr(obj, "__wrapped__"):
            fmt = obj.__wrapped__.__self__  # the sandbox's wrapper of str.format
            if obj.__name__ == "format":
                _format(c, fmt, args, kwargs)
            else:
                _format(c, fmt, (), args[0] if args else {})
            new = True
        c.depth += 1
        try:
            if c.depth > c.budget.max_depth:
                raise TemplateBudgetError(f"calls nested more than {c.budget.max_depth} deep (recursion)")
            result = super().call(context, obj, *args, **kwargs)
        finally:
            c.depth -= 1
        return c.made(result, "a call", new=new)
