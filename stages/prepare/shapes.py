"""Render-once preparation: a conversation's text and reply spans from a cached skeleton.

Most chat templates treat a message's content as opaque text: they branch on roles, positions
and flags, and paste the content in (maybe trimmed). For such a template, the rendered text of
a conversation is its *skeleton* - the render with every content swapped for a unique
placeholder - with each placeholder replaced by that content. The skeleton, and every reply
span the exact algorithm in `masking.py` finds in it, depend only on the conversation's
*shape*: its roles, which contents are empty, and every other message field verbatim
(tool calls, names). Prepare sees a handful of shapes in a dataset of millions of rows, so it
renders each shape a few times and then builds each row's text by concatenation: no template
render per row at all.

Exactness rests on two checks:

* `opaque_reason` reads the template's syntax tree and accepts it only when message content
  can reach nothing but the output: pasted, concatenated, trimmed (`| trim`, `.strip()`),
  tested for truthiness or type, or assigned to a variable held to the same rules. Any other
  use - comparing it, searching it (`'</think>' in content`), slicing, `tojson`, a length, a
  whole message printed or filtered, a call to a function such as `strftime_now` - and the
  template keeps the per-row path in `masking.py`.
* Per shape, a second skeleton with whitespace-padded placeholders shows whether the template
  trims contents; a template that trims some contents and not others, a reply span boundary
  that falls inside a placeholder, or anything unusual sends that shape to the per-row path.

A placeholder is `<open>j<close>`, a pair of private-use characters (`MARK_PAIRS`) that the
shape's fixed text (the template's own text, roles, names, tool calls) doesn't hold: the first
pair whose skeleton shows each mark once per content. Contents never enter a plan (only whether
each is empty), so any content - private-use characters included - is built from it exactly;
the plan holds no mark. Rows whose contents are not plain non-blank strings take the per-row
path. `tests/test_shapes.py` checks that both paths give the same text, spans and errors on
every real template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jinja2 import nodes

# Private-use characters (U+E000..): the placeholders' marks. Rows may hold them too (scraped text
# does): the per-row path picks, per row, one no message holds (`free_mark`); a plan, per shape, a
# pair its template text doesn't hold.
MARKS = ("\ue000", "\ue001", "\ue002", "\ue003", "\ue004", "\ue005")
MARK_PAIRS = tuple(zip(MARKS[::2], MARKS[1::2]))


def free_mark(texts) -> str:
    """The first of MARKS that none of `texts` holds; when they hold every one, a run of U+E000 one
    longer than the longest run in them. Either way no text holds the result."""
    texts = [t for t in texts if isinstance(t, str)]
    for mark in MARKS:
        if not any(mark in t for t in texts):
            return mark
    longest = max(len(run) for t in texts for run in re.findall(f"{MARKS[0]}+", t))
    return MARKS[0] * (longest + 1)


_C, _M = "content", "message"      # expression kinds: content text; a message or list of messages
_SAFE_TESTS = {"string", "defined", "undefined", "none"}
_SAFE_MESSAGE_TESTS = _SAFE_TESTS | {"mapping", "sequence", "iterable"}
_SAFE_CALLS = {"raise_exception", "namespace", "range"}
_ARITH = (nodes.Sub, nodes.Mul, nodes.Div, nodes.FloorDiv, nodes.Mod, nodes.Pow, nodes.Neg, nodes.Pos)


class _NotOpaque(Exception):
    pass


def _fail(node, why: str):
    raise _NotOpaque(f"line {getattr(node, 'lineno', '?')}: {why}")


class _Analyzer:
    """Abstract interpretation over kinds {content, message}; names join over all assignments."""

    def __init__(self, tree: nodes.Template):
        self.tree = tree
        self.names: dict[str, frozenset] = {"messages": frozenset({_M})}
        self.macros = {m.name for m in tree.find_all(nodes.Macro)}

    def run(self) -> None:
        for _ in range(8):  # to a fixpoint: a later assignment can taint an earlier use
            before = dict(self.names)
            self.stmts(self.tree.body)
            if self.names == before:
                return
        _fail(self.tree, "variable kinds do not settle")

    def bind(self, key: str, kind: frozenset) -> None:
        self.names[key] = self.names.get(key, frozenset()) | kind

    # statements -------------------------------------------------------------------------------
    def stmts(self, body) -> None:
        for n in body:
            self.stmt(n)

    def stmt(self, n) -> None:
        if isinstance(n, nodes.Output):
            for e in n.nodes:
                if _M in self.expr(e):
                    _fail(n, "a whole message is printed")
        elif isinstance(n, nodes.If):
            self.expr(n.test)  # truthiness: a placeholder is truthy exactly when a non-blank content is
            self.stmts(n.body)
            for e in n.elif_:
                self.stmt(e)
            self.stmts(n.else_)
        elif isinstance(n, nodes.For):
            it = self.expr(n.iter)
            if _C in it:
                _fail(n, "iterates over content")
            self.target(n.target, frozenset({_M}) if _M in it else frozenset())
            if n.test is not None:
                self.expr(n.test)
            if n.recursive:
                _fail(n, "recursive loop")
            self.stmts(n.body)
            self.stmts(n.else_)
        elif isinstance(n, nodes.Assign):
            self.target(n.target, self.expr(n.node))
        elif isinstance(n, nodes.AssignBlock):
            if n.filter is not None:
                _fail(n, "filtered set block")
            before = self._outputs_content(n.body)
            self.stmts(n.body)
            self.target(n.target, frozenset({_C}) if before else frozenset())
        elif isinstance(n, nodes.Macro):
            self.stmts(n.body)
        elif isinstance(n, nodes.CallBlock):
            call = n.call
            if not (isinstance(call, nodes.Call) and isinstance(call.node, nodes.ExtensionAttribute)
                    and call.node.name == "_generation_support"):
                _fail(n, "call block")
            self.stmts(n.body)  # {% generation %}: its body renders unchanged
        elif isinstance(n, nodes.ExprStmt):
            self.expr(n.node)
        elif isinstance(n, nodes.With):
            for t, v in zip(n.targets, n.values):
                self.target(t, self.expr(v))
            self.stmts(n.body)
        elif isinstance(n, (nodes.Break, nodes.Continue)):
            pass
        else:
            _fail(n, f"{type(n).__name__} statement")

    def _outputs_content(self, body) -> bool:
        return any(_C in self.expr(e) for o in nodes.Template(body).find_all(nodes.Output) for e in o.nodes)

    def target(self, t, kind: frozenset) -> None:
        if isinstance(t, nodes.Name):
            self.bind(t.name, kind)
        elif isinstance(t, nodes.NSRef):
            self.bind(f"{t.name}.{t.attr}", kind)
        elif isinstance(t, nodes.Tuple):
            if kind:
                _fail(t, "unpacks a message")
            for item in t.items:
                self.target(item, kind)
        else:
            _fail(t, f"assignment to {type(t).__name__}")

    # expressions ------------------------------------------------------------------------------
    def expr(self, e) -> frozenset:
        if isinstance(e, (nodes.Const, nodes.TemplateData)):
            return frozenset()
        if isinstance(e, nodes.Name):
            return self.names.get(e.name, frozenset())
        if isinstance(e, (nodes.Getattr, nodes.Getitem)):
            return self.access(e)
        if isinstance(e, nodes.Filter):
            base = self.expr(e.node) if e.node is not None else frozenset()
            for a in self._args(e):
                if self.expr(a):
                    _fail(e, f"message or content passed to filter {e.name}")
            if _C in base and e.name != "trim":
                _fail(e, f"content filtered by {e.name}")
            if _M in base and e.name != "length":
                _fail(e, f"message filtered by {e.name}")
            return frozenset({_C}) if _C in base else frozenset()
        if isinstance(e, nodes.Test):
            base = self.expr(e.node)
            for a in self._args(e):
                if self.expr(a):
                    _fail(e, f"message or content passed to test {e.name}")
            if _C in base and e.name not in _SAFE_TESTS:
                _fail(e, f"content tested with {e.name}")
            if _M in base and e.name not in _SAFE_MESSAGE_TESTS:
                _fail(e, f"message tested with {e.name}")
            return frozenset()
        if isinstance(e, (nodes.Add, nodes.Concat)):
            parts = [e.left, e.right] if isinstance(e, nodes.Add) else e.nodes
            kinds = frozenset().union(*(self.expr(p) for p in parts))
            if _M in kinds:
                _fail(e, "messages concatenated")
            return kinds
        if isinstance(e, (nodes.And, nodes.Or)):  # the value is one operand's
            return self.expr(e.left) | self.expr(e.right)
        if isinstance(e, nodes.Not):
            self.expr(e.node)
            return frozenset()
        if isinstance(e, nodes.CondExpr):
            self.expr(e.test)
            return self.expr(e.expr1) | (self.expr(e.expr2) if e.expr2 is not None else frozenset())
        if isinstance(e, nodes.Compare):
            if self.expr(e.expr) or any(self.expr(op.expr) for op in e.ops):
                _fail(e, "message or content compared")
            return frozenset()
        if isinstance(e, _ARITH):
            parts = [e.node] if isinstance(e, (nodes.Neg, nodes.Pos)) else [e.left, e.right]
            if any(self.expr(p) for p in parts):
                _fail(e, f"message or content in {type(e).__name__}")
            return frozenset()
        if isinstance(e, nodes.Call):
            return self.call(e)
        if isinstance(e, (nodes.List, nodes.Tuple)):
            if any(self.expr(i) for i in e.items):
                _fail(e, "message or content in a literal")
            return frozenset()
        if isinstance(e, nodes.Dict):
            if any(self.expr(p.key) or self.expr(p.value) for p in e.items):
                _fail(e, "message or content in a literal")
            return frozenset()
        if isinstance(e, nodes.Slice):
            for p in (e.start, e.stop, e.step):
                if p is not None and self.expr(p):
                    _fail(e, "message or content in a slice")
            return frozenset()
        _fail(e, f"{type(e).__name__} expression")

    def _args(self, e) -> list:
        return list(e.args) + [k.value for k in e.kwargs] + [a for a in (e.dyn_args, e.dyn_kwargs) if a is not None]

    def access(self, e) -> frozenset:
        base_node = e.node
        if isinstance(e, nodes.Getattr):
            key = e.attr
        else:
            if self.expr(e.arg):
                _fail(e, "indexed by a message or content")
            key = e.arg.value if isinstance(e.arg, nodes.Const) else None
        if isinstance(base_node, nodes.Name) and isinstance(e, nodes.Getattr):
            if base_node.name == "loop" and key in ("previtem", "nextitem", "cycle"):
                return frozenset({_M})
            ns_key = f"{base_node.name}.{key}"
            if ns_key in self.names:
                return self.names[ns_key]
        base = self.expr(base_node)
        if _C in base:
            _fail(e, "content indexed or its method used")
        if _M not in base:
            return frozenset()
        if key == "content":
            return frozenset({_C})
        if isinstance(key, str):
            return frozenset()  # role, tool_calls, name, ...: part of the shape, rendered per shape
        return frozenset({_M})  # messages[i], messages[1:], message[k]

    def call(self, e: nodes.Call) -> frozenset:
        args = self._args(e)
        fn = e.node
        if isinstance(fn, nodes.Getattr):
            base = self.expr(fn.node)
            if _C in base:
                if fn.attr == "strip" and not args:
                    return frozenset({_C})
                _fail(e, f"content method {fn.attr}")
            if _M in base:
                if fn.attr == "get" and e.args and isinstance(e.args[0], nodes.Const) and not self.expr(e.args[0]):
                    for a in args[1:]:
                        if self.expr(a):
                            _fail(e, "message or content as a default")
                    return frozenset({_C}) if e.args[0].value == "content" else frozenset()
                _fail(e, f"message method {fn.attr}")
        elif isinstance(fn, nodes.Name):
            if fn.name not in _SAFE_CALLS and fn.name not in self.macros:
                _fail(e, f"calls {fn.name}")
        else:
            _fail(e, "call of a computed function")
        if any(self.expr(a) for a in args):
            _fail(e, "message or content passed to a call")
        return frozenset()


def opaque_reason(env, source: str) -> str | None:
    """None when the template only passes message content through to its output; else why not."""
    try:
        tree = env.parse(source)
        _Analyzer(tree).run()
    except _NotOpaque as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a syntax the analyzer doesn't know is simply not proven opaque
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------------------- per-shape plans


@dataclass(frozen=True)
class ShapePlan:
    """A shape's skeleton cut at its contents: fixed, msg index, fixed, ..., fixed; each span
    boundary as (piece index, offset within a fixed piece) or ("end", j) = end of content j,
    whose trailing whitespace the exact algorithm strips."""
    pieces: tuple
    trimmed: bool
    spans: tuple


def shape_key(messages: list[dict]) -> tuple | None:
    """What a template may branch on; None when the row must take the per-row path."""
    key = []
    for m in messages:
        c = m.get("content")
        if not isinstance(c, str) or (c and not c.strip()):
            return None
        if len(m) == 2 and isinstance(m.get("role"), str):  # the common case, without json's cost
            key.append((bool(c), "role", m["role"]))
            continue
        rest = {k: v for k, v in m.items() if k != "content"}
        try:
            key.append((bool(c), "json", json.dumps(rest, sort_keys=True, ensure_ascii=False)))
        except (TypeError, ValueError):
            return None
    return tuple(key)


def build(contents: list[str], plan: ShapePlan) -> tuple[str, list[tuple[int, int]]] | None:
    """The row's text and spans from its shape's plan; None if a span end needs the per-row path."""
    starts, out, pos = [], [], 0
    for piece in plan.pieces:
        starts.append(pos)
        if isinstance(piece, int):
            piece = contents[piece].strip() if plan.trimmed else contents[piece]
        out.append(piece)
        pos += len(piece)
    spans = []
    for a, b in plan.spans:
        bounds = []
        for ref in (a, b):
            if ref[0] == "end":
                k = ref[1]
                piece = out[k]
                if piece != piece.rstrip():
                    return None
                bounds.append(starts[k] + len(piece))
            else:
                bounds.append(starts[ref[0]] + ref[1])
        spans.append(tuple(bounds))
    return "".join(out), spans


def common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # largest k with a[:k] == b[:k]; C-speed probes, O(log n) of them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_for(render, messages: list[dict], loss_on: str) -> ShapePlan | None:
    """The plan of this row's shape, found the way `masking.assistant_spans` finds spans but on
    placeholders; None when the shape needs the per-row path. `render` raises on template errors.
    Placeholders are marked by the first of `MARK_PAIRS` the shape's fixed text doesn't hold."""
    for pair in MARK_PAIRS:
        plan = _plan(render, messages, loss_on, *pair)
        if plan is not _MARKS_TAKEN:
            return plan
    return None


_MARKS_TAKEN = object()  # the template's text holds a mark: try the next pair


def _plan(render, messages: list[dict], loss_on: str, mark: str, close: str):
    def ph(j) -> str:
        return f"{mark}{j}{close}"

    marked = [dict(m, content=ph(j) if m["content"] else "") for j, m in enumerate(messages)]
    skeleton = render(marked)
    filled = [j for j, m in enumerate(messages) if m["content"]]
    if skeleton.count(mark) != len(filled) or skeleton.count(close) != len(filled):
        return _MARKS_TAKEN  # or a content rendered twice or not at all: then no pair helps, and None follows
    padded = render([dict(m, content=f" {m['content']} " if m["content"] else "") for m in marked])
    spaced = skeleton
    for j in filled:
        spaced = spaced.replace(ph(j), f" {ph(j)} ")
    if padded == spaced:
        trimmed = False
    elif padded == skeleton:
        trimmed = True
    else:  # trims some contents and not others, or reacts to content length
        return None
    at = {}
    for j in filled:
        k = skeleton.find(ph(j))
        if k < 0 or skeleton.find(ph(j), k + 1) >= 0:
            return None
        at[k] = j
    pieces, piece_at, last = [], {}, 0  # piece_at: message -> index of its piece
    for k in sorted(at):
        pieces.append(skeleton[last:k])
        piece_at[at[k]] = len(pieces)
        pieces.append(at[k])
        last = k + len(ph(at[k]))
    pieces.append(skeleton[last:])
    if any(mark in p or close in p for p in pieces if isinstance(p, str)):
        return None
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(ph(p)) if isinstance(p, int) else len(p)

    def locate(x: int):  # a skeleton position inside fixed text -> (piece, offset)
        for idx in range(len(pieces) - 1, -1, -1):
            if starts[idx] <= x and isinstance(pieces[idx], str) and x <= starts[idx] + len(pieces[idx]):
                return (idx, x - starts[idx])
        return None

    if loss_on == "all":
        return ShapePlan(tuple(pieces), trimmed, (((0, 0), (len(pieces) - 1, len(pieces[-1]))),))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        turns = turns[-1:]
    spans = []
    for i in turns:
        if i not in piece_at:  # a reply without text (a tool call): the per-row path
            return None
        p = piece_at[i]
        start = starts[p]
        start_ref = (p, 0)
        if start > 0 and skeleton[start - 1] == " ":
            if not (isinstance(pieces[p - 1], str) and pieces[p - 1]):
                return None
            start, start_ref = start - 1, (p - 1, len(pieces[p - 1]) - 1)
        reply_end = starts[p] + len(ph(i))
        if i == len(messages) - 1:
            end = len(skeleton)
        else:
            prefix = render(marked[: i + 1])
            end = common_prefix_len(prefix, skeleton)
            if end < len(prefix) and (end >= len(skeleton) or mark in (skeleton[end], prefix[end])):
                return None
        while end > 0 and skeleton[end - 1].isspace():
            end -= 1
        if end < reply_end or end <= start:
            return None
        if skeleton[end - 1] == close:
            j = at.get(skeleton.rfind(mark, 0, end))
            if j is None:
                return None
            end_ref = ("end", piece_at[j])
        else:
            end_ref = locate(end)
            if end_ref is None:
                return None
        spans.append((start_ref, end_ref))
    return ShapePlan(tuple(pieces), trimmed, tuple(spans))
