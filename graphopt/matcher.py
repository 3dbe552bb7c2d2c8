"""The one pattern matcher: a small structural DSL over canonical (ATen) graphs.

    from graphopt.matcher import Op, Any, Attr, find
    pat = Op(aten.batch_norm.default, Op(aten.conv2d.default, Any("x"), Attr("w"), name="conv"),
             Attr("bn_w"), Attr("bn_b"), Attr("mean"), Attr("var"), Const("training", False), name="bn")
    for m in find(gm, pat):
        m["conv"], m["x"], m.nodes ...

Positional arguments are matched in order (arguments given by keyword are looked up through
the op's schema); arguments past the pattern's are not constrained. Interior nodes of a match
(every matched op node but the root) must have no users outside the match unless the pattern
says ``single_use=False``. Set ``GRAPHOPT_DEBUG_MATCH=1`` to log why candidate roots fail.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.fx as fx

log = logging.getLogger("graphopt.matcher")
_DEBUG = os.environ.get("GRAPHOPT_DEBUG_MATCH", "") not in ("", "0")

_MISSING = object()


def get_arg(node: fx.Node, index: int, name: str | None = None, default=_MISSING):
    """Argument ``index`` of a call node, whether passed by position or keyword (schema-aware)."""
    if index < len(node.args):
        return node.args[index]
    target = node.target
    if name is None and isinstance(target, torch._ops.OpOverload):
        args = target._schema.arguments
        if index < len(args):
            name = args[index].name
            if name not in node.kwargs and args[index].has_default_value():
                return node.kwargs.get(name, args[index].default_value) if default is _MISSING else node.kwargs.get(name, default)
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        return None
    return default


class Pattern:
    name: str | None = None

    def match(self, value, m: "Match") -> bool:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class Match:
    root: fx.Node
    bindings: dict = field(default_factory=dict)
    nodes: list = field(default_factory=list)  # matched op nodes, root first
    why: str = ""

    def __getitem__(self, key):
        return self.bindings[key]

    def get(self, key, default=None):
        return self.bindings.get(key, default)

    def fail(self, why: str) -> bool:
        if not self.why:
            self.why = why
        return False


class Any(Pattern):
    """Any value (node or literal); optional predicate on it."""

    def __init__(self, name: str | None = None, pred: Callable | None = None):
        self.name, self.pred = name, pred

    def match(self, value, m):
        if self.pred is not None and not self.pred(value):
            return m.fail(f"{self.name or 'value'} {value!r} fails its predicate")
        return _bind(self.name, value, m)


class Attr(Pattern):
    """A get_attr node (a parameter, buffer or folded constant)."""

    def __init__(self, name: str | None = None, optional: bool = False):
        self.name, self.optional = name, optional

    def match(self, value, m):
        if value is None and self.optional:
            return _bind(self.name, None, m)
        if not isinstance(value, fx.Node) or value.op != "get_attr":
            return m.fail(f"{self.name or 'attr'} is {_desc(value)}, not a parameter/buffer")
        return _bind(self.name, value, m)


class Const(Pattern):
    """A literal argument equal to ``value`` (or satisfying ``pred``)."""

    def __init__(self, name: str | None = None, value=_MISSING, pred: Callable | None = None):
        self.name, self.value, self.pred = name, value, pred

    def match(self, value, m):
        if isinstance(value, fx.Node):
            return m.fail(f"{self.name or 'const'} is a node, not a literal")
        if self.value is not _MISSING and value != self.value:
            return m.fail(f"{self.name or 'const'} is {value!r}, wanted {self.value!r}")
        if self.pred is not None and not self.pred(value):
            return m.fail(f"{self.name or 'const'} {value!r} fails its predicate")
        return _bind(self.name, value, m)


class Alt(Pattern):
    """The first of several alternative patterns that matches (bindings of failed tries undone)."""

    def __init__(self, *alternatives: Pattern, name: str | None = None):
        self.alternatives, self.name = alternatives, name

    def match(self, value, m):
        for alt in self.alternatives:
            saved_b, saved_n, saved_why = dict(m.bindings), list(m.nodes), m.why
            if alt.match(value, m):
                return _bind(self.name, value, m)
            m.bindings, m.nodes, m.why = saved_b, saved_n, saved_why
        return m.fail(f"{_desc(value)} matches none of {len(self.alternatives)} alternatives")


class Op(Pattern):
    """A call_function node whose target is one of ``targets`` (overloads or packets).

    ``commutative=True`` also tries the first two arguments swapped (add, mul)."""

    def __init__(self, targets, *args: Pattern, name: str | None = None, single_use: bool = True,
                 pred: Callable | None = None, kwargs: dict | None = None, commutative: bool = False):
        self.targets = targets if isinstance(targets, (tuple, list, set, frozenset)) else (targets,)
        self.args, self.name, self.single_use, self.pred = args, name, single_use, pred
        self.kwargs = kwargs or {}
        self.commutative = commutative

    def _target_ok(self, node: fx.Node) -> bool:
        for t in self.targets:
            if node.target is t:
                return True
            if isinstance(t, torch._ops.OpOverloadPacket) and isinstance(node.target, torch._ops.OpOverload) \
                    and node.target.overloadpacket is t:
                return True
        return False

    def match(self, value, m):
        if not isinstance(value, fx.Node) or value.op != "call_function":
            return m.fail(f"{self.name or 'op'} expected a call, found {_desc(value)}")
        if not self._target_ok(value):
            return m.fail(f"{value.name} is {_desc(value)}, not {'/'.join(map(str, self.targets))}")
        if value in m.nodes:
            return _bind(self.name, value, m)
        # readers outside the match are checked once the whole match is known (match())
        m.nodes.append(value)
        orders = [list(range(len(self.args)))]
        if self.commutative and len(self.args) >= 2:
            orders.append([1, 0] + list(range(2, len(self.args))))
        for k, order in enumerate(orders):
            saved_b, saved_n = dict(m.bindings), list(m.nodes)
            if all(sub.match(get_arg(value, j), m) for sub, j in zip(self.args, order)):
                break
            m.bindings, m.nodes = saved_b, saved_n
            if k == len(orders) - 1:
                return False
        for kname, sub in self.kwargs.items():
            if not sub.match(value.kwargs.get(kname, get_arg(value, _schema_index(value, kname))), m):
                return False
        if self.pred is not None and not self.pred(value):
            return m.fail(f"{value.name} fails the pattern's condition")
        return _bind(self.name, value, m)


def _schema_index(node, name):
    if isinstance(node.target, torch._ops.OpOverload):
        for i, a in enumerate(node.target._schema.arguments):
            if a.name == name:
                return i
    return 10**6


def _bind(name, value, m: Match) -> bool:
    if name is None:
        return True
    if name in m.bindings and m.bindings[name] is not value:
        return m.fail(f"{name} bound twice to different values")
    m.bindings[name] = value
    return True


def _desc(value) -> str:
    if isinstance(value, fx.Node):
        return f"{value.op} {value.target}"
    return repr(value)


def match(pattern: Pattern, node: fx.Node) -> Match | None:
    m = Match(root=node)
    if pattern.match(node, m):
        # interior nodes may only feed other matched nodes
        inside = set(m.nodes)
        for n in m.nodes[1:]:
            if any(u not in inside for u in n.users) and _needs_single_use(pattern, n):
                m.why = f"{n.name} is read outside the match; fusing it would duplicate work"
                _log(node, m)
                return None
        return m
    _log(node, m)
    return None


def _needs_single_use(pattern: Pattern, node: fx.Node) -> bool:
    stack = [pattern]
    while stack:
        p = stack.pop()
        if isinstance(p, Op):
            if p.single_use is False and p._target_ok(node):
                return False
            stack.extend(p.args)
            stack.extend(p.kwargs.values())
        elif isinstance(p, Alt):
            stack.extend(p.alternatives)
    return True


def _log(node, m):
    if _DEBUG and m.why:
        log.warning("no match at %s: %s", node.name, m.why)


def find(gm: fx.GraphModule, pattern: Pattern) -> Iterator[Match]:
    """Every match of ``pattern`` rooted at a node of ``gm`` (in graph order; may overlap)."""
    roots = pattern.targets if isinstance(pattern, Op) else None
    for node in list(gm.graph.nodes):
        if roots is not None and (node.op != "call_function" or not pattern._target_ok(node)):
            continue
        m = match(pattern, node)
        if m is not None:
            yield m
