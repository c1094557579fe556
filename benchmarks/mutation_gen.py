"""Mutants generated from a module's syntax tree, so that a round's count does not depend on who
wrote the table.

The operators are the realistic ones of mutmut and cosmic-ray, in nine families:

* ``constant``: a number n -> n + 1 and 2n (floats: 2x and x / 2), 0 <-> 1;
* ``unit``: a unit-like constant one step along its ladder (1e3 <-> 1e6 <-> 1e9, 1e-3 <-> 1e-6,
  1024 <-> 1000, 2**20 <-> 2**30);
* ``boundary``: ``<`` <-> ``<=``, ``>`` <-> ``>=``;
* ``arithmetic``: ``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``/`` (and the augmented forms);
* ``dropped_term``: one operand of a sum, a product or a quotient left out;
* ``swapped``: two neighbouring positional arguments of a call, the two values of a pair;
* ``condition``: ``True`` <-> ``False``, ``not x`` -> ``x``, an ``if``'s test negated,
  ``and`` <-> ``or``, ``==`` <-> ``!=``, ``is`` <-> ``is not``, ``in`` <-> ``not in``;
* ``min_max``: min <-> max (minimum, amin, argmin, nanmin, idxmin, cummin, clamp_min), floor <-> ceil;
* ``return``: ``return x`` -> ``return None``, a guard's test made ``True`` (returns early),
  ``break`` <-> ``continue``.

Left alone: strings (docstrings, messages, f-strings), type annotations, decorators, imports,
the arguments of logging/print/warnings calls and of ``raise``, an ``assert``'s message, cosmetic
keyword arguments (width, height, alpha, ...), ``if __name__ == "__main__"`` and
``if TYPE_CHECKING`` blocks, and every line marked ``# pragma: no mutate``.

Each edit is a byte range of the file and its replacement text, found from the syntax tree's
exact positions (an operator's own position from the source between its operands); an edit
that does not parse is dropped.  ``sample`` draws N per module with a seed (the same seed and
source give the same mutants), taking from each family in turn so that no family (numbers,
usually the most numerous) crowds the others out; a mutant provably equivalent to the original
(the same syntax tree, or the same bytecode after constant folding) is marked, not run.
"""

from __future__ import annotations

import ast
import bisect
import random
import re
import types
from dataclasses import dataclass
from pathlib import Path

from benchmarks.mutation_table import Mutant

FAMILIES = (
    "constant",
    "unit",
    "boundary",
    "arithmetic",
    "dropped_term",
    "swapped",
    "condition",
    "min_max",
    "return",
)
PRAGMA = "pragma: no mutate"
LOGGERS = {"log", "logger", "logging", "LOG", "LOGGER", "_log", "_logger", "warnings"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception"}
QUIET_CALLS = {"print", "warn", "set_postfix_str", "set_postfix", "set_description", "write"}
COSMETIC = {
    "width", "height", "frame_width", "frame_height", "fontsize", "font_size", "fontscale", "alpha",
    "line_width", "linewidth", "size", "marker_size", "figsize", "dpi", "padding", "rotation",
    "xrotation", "yrotation", "stacklevel", "indent", "ncols", "mininterval", "position", "leave",
}  # fmt: skip
MIN_MAX = {"min": "max", "minimum": "maximum", "amin": "amax", "argmin": "argmax", "nanmin": "nanmax",
           "idxmin": "idxmax", "cummin": "cummax", "clamp_min": "clamp_max", "nsmallest": "nlargest",
           "floor": "ceil"}  # fmt: skip
MIN_MAX.update({v: k for k, v in list(MIN_MAX.items())})
NO_SWAP = {"isinstance", "issubclass", "getattr", "setattr", "hasattr", "delattr", "super", "type", "cast"}
DECIMAL = [1e-12, 1e-9, 1e-6, 1e-3, 1e3, 1e6, 1e9, 1e12]
BINARY = {1024: 1000, 1048576: 1e6, 1073741824: 1e9, 1099511627776: 1e12}
CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">")}
NEG = {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
       ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}  # fmt: skip
ARITH = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"), ast.FloorDiv: ("//", "/")}
TOKEN = {  # an operator's token in the source between two operands (comments removed first)
    "<": r"(?<![<>=!])<(?![<=])", "<=": r"<=", ">": r"(?<![<>=-])>(?![>=])", ">=": r">=", "==": r"==",
    "!=": r"!=", "is": r"\bis\b(?!\s+not\b)", "is not": r"\bis\s+not\b", "in": r"(?<!not )\bin\b",
    "not in": r"\bnot\s+in\b", "+": r"(?<![+=])\+(?!=)", "-": r"(?<![-=])-(?![=>])", "*": r"(?<!\*)\*(?![*=])",
    "/": r"(?<!/)/(?![/=])", "//": r"//(?!=)", "and": r"\band\b", "or": r"\bor\b", "**": r"\*\*",
    "+=": r"\+=", "-=": r"-=", "*=": r"(?<!\*)\*=", "/=": r"(?<!/)/=", "//=": r"//=",
}  # fmt: skip


@dataclass(frozen=True)
class Edit:
    start: int  # byte offsets into the file's UTF-8 text
    end: int
    replace: str
    family: str
    operator: str
    why: str
    line: int
    col: int


class _Collector(ast.NodeVisitor):
    def __init__(self, source: bytes):
        self.src = source
        self.starts = [0] + [m.end() for m in re.finditer(b"\n", source)]
        self.quiet = {i + 1 for i, ln in enumerate(source.split(b"\n")) if PRAGMA.encode() in ln}
        self.edits: list[Edit] = []
        self.scope: list[str] = []

    # ---- positions
    def off(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.off(node.lineno, node.col_offset), self.off(node.end_lineno, node.end_col_offset)

    def text(self, a: int, b: int) -> str:
        return self.src[a:b].decode("utf-8")

    def token(self, a: int, b: int, tok: str) -> tuple[int, int] | None:
        """The byte range of operator ``tok`` in the source between offsets a and b."""
        gap = self.src[a:b].decode("utf-8")
        clean = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), gap)
        hits = list(re.finditer(TOKEN[tok], clean))
        if len(hits) != 1:
            return None
        i, j = hits[0].span()
        return a + len(gap[:i].encode()), a + len(gap[:j].encode())

    def add(self, a: int, b: int, replace: str, family: str, operator: str, why: str) -> None:
        line = bisect.bisect_right(self.starts, a)
        if line in self.quiet:
            return
        where = ".".join(self.scope) or "module level"
        col = a - self.starts[line - 1]
        self.edits.append(Edit(a, b, replace, family, operator, f"{why} in {where}", line, col))

    # ---- what is left alone
    def visit_Import(self, node):  # noqa: N802
        pass

    visit_ImportFrom = visit_Import  # noqa: N815
    visit_JoinedStr = visit_Import  # noqa: N815
    visit_Raise = visit_Import  # noqa: N815
    visit_arg = visit_Import  # noqa: N815

    def visit_Expr(self, node):  # noqa: N802
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring or a bare string
        self.visit(node.value)

    def visit_Assert(self, node):  # noqa: N802
        self.visit(node.test)  # not the message

    def visit_AnnAssign(self, node):  # noqa: N802
        if node.value is not None:
            self.visit(node.value)

    def _function(self, node):
        self.scope.append(node.name)
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    visit_FunctionDef = _function  # noqa: N815
    visit_AsyncFunctionDef = _function  # noqa: N815

    def visit_ClassDef(self, node):  # noqa: N802
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def visit_Assign(self, node):  # noqa: N802
        names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        if names & {"__all__", "__slots__"}:
            return
        pair = node.value.elts if isinstance(node.value, ast.Tuple) else ()
        if len(pair) == 2 and isinstance(node.targets[0], ast.Tuple) and _kind(pair[0]) == _kind(pair[1]) != "str":
            self._swap(node.value.elts[0], node.value.elts[1], "swap_pair", "the two values of a pair swapped")
        self.generic_visit(node)

    # ---- calls
    def visit_Call(self, node):  # noqa: N802
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if name in QUIET_CALLS or owner in LOGGERS or (name in LOG_METHODS and "log" in owner.lower()):
            return
        if name in MIN_MAX:
            a, b = self.span(f)
            self.add(b - len(name.encode()), b, MIN_MAX[name], "min_max", "min_max", f"{name} became {MIN_MAX[name]}")
        if name not in MIN_MAX and name not in NO_SWAP and not any(isinstance(x, ast.Starred) for x in node.args):
            for x, y in zip(node.args, node.args[1:]):
                if _kind(x) == _kind(y) in ("number", "value"):
                    self._swap(x, y, "swap_args", f"two arguments of {name or 'a call'} swapped")
        self.visit(f)
        for x in node.args:
            self.visit(x)
        for k in node.keywords:
            if k.arg not in COSMETIC:
                self.visit(k.value)

    def _swap(self, x: ast.AST, y: ast.AST, operator: str, why: str) -> None:
        (xa, xb), (ya, yb) = self.span(x), self.span(y)
        tx, ty = self.text(xa, xb), self.text(ya, yb)
        if tx != ty:
            self.add(xa, yb, ty + self.text(xb, ya) + tx, "swapped", operator, why)

    # ---- conditions and control flow
    def visit_If(self, node):  # noqa: N802
        t = node.test
        src = ast.unparse(t)
        if src in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or "__name__" in src and "__main__" in src:
            return
        a, b = self.span(t)
        if not isinstance(t, ast.UnaryOp) or not isinstance(t.op, ast.Not):
            self.add(a, b, f"not ({self.text(a, b)})", "condition", "negate_condition", "an if's test negated")
        if isinstance(node.body[-1], ast.Return) and not (isinstance(t, ast.Constant) and t.value is True):
            self.add(a, b, "True", "return", "return_early", "a guard always taken (returns early)")
        self.generic_visit(node)

    def visit_IfExp(self, node):  # noqa: N802
        a, b = self.span(node.test)
        self.add(a, b, f"not ({self.text(a, b)})", "condition", "negate_condition", "a conditional's test negated")
        self.generic_visit(node)

    def visit_Return(self, node):  # noqa: N802
        v = node.value
        if v is not None and not (isinstance(v, ast.Constant) and v.value is None):
            a, b = self.span(node)
            self.add(a, b, "return None", "return", "return_none", "returns None")
        self.generic_visit(node)

    def visit_Break(self, node):  # noqa: N802
        a, b = self.span(node)
        self.add(a, b, "continue", "return", "break_continue", "break became continue")

    def visit_Continue(self, node):  # noqa: N802
        a, b = self.span(node)
        self.add(a, b, "break", "return", "break_continue", "continue became break")

    def visit_BoolOp(self, node):  # noqa: N802
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for x, y in zip(node.values, node.values[1:]):
            hit = self.token(self.span(x)[1], self.span(y)[0], old)
            if hit:
                self.add(*hit, new, "condition", "and_or", f"{old} became {new}")
        self.generic_visit(node)

    def visit_UnaryOp(self, node):  # noqa: N802
        if isinstance(node.op, ast.Not):
            a, b = self.span(node)
            rest = self.text(a, b)[3:].lstrip()
            self.add(a, b, rest, "condition", "not_dropped", "a not dropped")
        self.generic_visit(node)

    def visit_Compare(self, node):  # noqa: N802
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            pair = CMP.get(type(op)) or NEG.get(type(op))
            if pair:
                hit = self.token(self.span(left)[1], self.span(right)[0], pair[0])
                if hit:
                    fam, name = ("boundary", "boundary") if type(op) in CMP else ("condition", "compare_negated")
                    self.add(*hit, pair[1], fam, name, f"{pair[0]} became {pair[1]}")
            left = right
        self.generic_visit(node)

    # ---- arithmetic
    @staticmethod
    def _stringy(x: ast.AST) -> bool:
        return isinstance(x, ast.JoinedStr) or (isinstance(x, ast.Constant) and isinstance(x.value, (str, bytes)))

    def visit_BinOp(self, node):  # noqa: N802
        if self._stringy(node.left) or self._stringy(node.right):
            return  # building a string
        a, b = self.span(node)
        la, lb = self.span(node.left)
        ra, rb = self.span(node.right)
        pair = ARITH.get(type(node.op))
        hit = self.token(lb, ra, pair[0]) if pair else None
        if hit:
            self.add(*hit, pair[1], "arithmetic", "arithmetic", f"{pair[0]} became {pair[1]}")
            left_text, right_text = self.text(a, hit[0]).rstrip(), self.text(hit[1], b).lstrip()
            self.add(a, b, left_text, "dropped_term", "drop_right", f"the operand after {pair[0]} dropped")
            if isinstance(node.op, (ast.Add, ast.Mult)):
                self.add(a, b, right_text, "dropped_term", "drop_left", f"the operand before {pair[0]} dropped")
        if self._power_of_two(node):
            exp = node.right.value
            for e, name in ((exp - 10, "unit_down"), (exp + 10, "unit_up")):
                if e > 0:
                    self.add(ra, rb, str(e), "unit", name, f"2**{exp} became 2**{e}")
            return
        self.generic_visit(node)

    @staticmethod
    def _power_of_two(node: ast.BinOp) -> bool:
        return (
            isinstance(node.op, ast.Pow)
            and isinstance(node.left, ast.Constant)
            and node.left.value == 2
            and isinstance(node.right, ast.Constant)
            and node.right.value in (10, 20, 30, 40)
        )

    def visit_AugAssign(self, node):  # noqa: N802
        pair = ARITH.get(type(node.op))
        if pair:
            hit = self.token(self.span(node.target)[1], self.span(node.value)[0], pair[0] + "=")
            if hit:
                self.add(*hit, pair[1] + "=", "arithmetic", "arithmetic", f"{pair[0]}= became {pair[1]}=")
        self.generic_visit(node)

    def visit_Constant(self, node):  # noqa: N802
        v = node.value
        a, b = self.span(node)
        if isinstance(v, bool):
            self.add(a, b, str(not v), "condition", "bool_inverted", f"{v} became {not v}")
            return
        if not isinstance(v, (int, float)) or isinstance(v, complex):
            return
        text = self.text(a, b)
        if v in BINARY or float(v) in DECIMAL or (isinstance(v, int) and v in (1000, 1_000_000)):
            for w, name in _unit_steps(v):
                self.add(a, b, _literal(w, v, text), "unit", name, f"{text} became {_literal(w, v, text)}")
            return
        for w, name in _constant_steps(v):
            self.add(a, b, _literal(w, v, text), "constant", name, f"{text} became {_literal(w, v, text)}")


def _kind(x: ast.AST) -> str:
    """What sort of argument: swapping a number with a variable is a type error, not a plausible bug."""
    if isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.USub):
        x = x.operand
    if isinstance(x, ast.Constant):
        v = x.value
        return (
            "none"
            if v is None
            else "str"
            if isinstance(v, (str, bytes))
            else "bool"
            if isinstance(v, bool)
            else "number"
        )
    if isinstance(x, ast.JoinedStr):
        return "str"
    return "literal" if isinstance(x, (ast.List, ast.Tuple, ast.Dict, ast.Set)) else "value"


def _unit_steps(v: int | float) -> list[tuple[float | int, str]]:
    if v in BINARY:
        return [(BINARY[v], "unit_decimal")]
    f = float(v)
    i = DECIMAL.index(f) if f in DECIMAL else -9
    out = [(DECIMAL[j], name) for j, name in ((i - 1, "unit_down"), (i + 1, "unit_up")) if 0 <= j < len(DECIMAL)]
    binary = {1e3: 1024, 1e6: 1048576, 1e9: 1073741824}
    return out + ([(binary[f], "unit_binary")] if f in binary else [])


def _constant_steps(v: int | float) -> list[tuple[int | float, str]]:
    if v == 0:
        return [(1 if isinstance(v, int) else 1.0, "constant_zero_one")]
    if v == 1:
        return [
            (0 if isinstance(v, int) else 0.0, "constant_zero_one"),
            (2 if isinstance(v, int) else 2.0, "constant_double"),
        ]
    if isinstance(v, int):
        return [(v + 1, "constant_plus_one"), (2 * v, "constant_double")]
    return [(2 * v, "constant_double"), (v / 2, "constant_half")]


def _literal(w: int | float, v: int | float, text: str) -> str:
    """``w`` written the way the literal it replaces was (an int stays an int, 1e3 style stays)."""
    if isinstance(v, int) and isinstance(w, float) and w.is_integer():
        w = int(w)
    if isinstance(w, int) and text.lower().startswith("0x"):
        return hex(w)
    if isinstance(w, float) and ("e" in text.lower() or abs(w) >= 1e5 or (w != 0 and abs(w) < 1e-4)):
        mant, exp = f"{w:.12e}".split("e")
        mant = mant.rstrip("0").rstrip(".")
        return f"{mant}e{int(exp)}"
    return repr(w)


# ------------------------------------------------------------------------------ the generator
def edits(source: bytes) -> list[Edit]:
    """Every candidate edit of a module's source (each parsing), in source order."""
    col = _Collector(source)
    col.visit(ast.parse(source))
    seen, out = set(), []
    for e in sorted(col.edits, key=lambda e: (e.start, e.end, e.replace)):
        key = (e.start, e.end, e.replace)
        if key not in seen and source[e.start : e.end].decode() != e.replace:
            seen.add(key)
            out.append(e)
    return out


def _code_key(co: types.CodeType) -> tuple:
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c)) for c in co.co_consts)
    return co.co_code, consts, co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars, co.co_name


def equivalence(original: bytes, mutated: bytes) -> str:
    """Why ``mutated`` provably behaves like ``original`` ('' when it cannot be shown trivially)."""
    return _Original(original).equivalence(mutated)


class _Original:
    """A module's syntax tree and bytecode, computed once for all its mutants."""

    def __init__(self, source: bytes):
        self.tree = ast.dump(ast.parse(source))
        self.code = _code_key(compile(source, "<m>", "exec", dont_inherit=True))

    def equivalence(self, mutated: bytes) -> str:
        if ast.dump(ast.parse(mutated)) == self.tree:
            return "the same syntax tree"
        try:
            if _code_key(compile(mutated, "<m>", "exec", dont_inherit=True)) == self.code:
                return "the same bytecode"
        except (SyntaxError, ValueError):
            return ""
        return ""


def parses(source: bytes) -> bool:
    try:
        compile(source, "<mutant>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def sample(file: str, source: bytes, count: int, seed: int) -> list[Mutant]:
    """``count`` mutants of one module, drawn with ``seed`` from each family in turn."""
    rng = random.Random(f"{seed}:{file}")
    by_family: dict[str, list[Edit]] = {f: [] for f in FAMILIES}
    for e in edits(source):
        by_family[e.family].append(e)
    order = [f for f in FAMILIES if by_family[f]]
    rng.shuffle(order)
    for f in order:
        rng.shuffle(by_family[f])
    picked: list[tuple[Edit, bytes]] = []
    texts: set[bytes] = set()
    while len(picked) < count and any(by_family[f] for f in order):
        for f in order:
            if len(picked) >= count:
                break
            while by_family[f]:
                e = by_family[f].pop()
                mutated = source[: e.start] + e.replace.encode() + source[e.end :]
                if mutated not in texts and parses(mutated):
                    texts.add(mutated)
                    picked.append((e, mutated))
                    break
    stem, original = Path(file).stem, _Original(source)
    out, ids = [], set()
    for e, mutated in sorted(picked, key=lambda p: (p[0].start, p[0].operator, p[0].replace)):
        base = f"{stem}:{e.line}:{e.col}:{e.operator}"
        uid = next(f"{base}{k or ''}" for k in range(len(ids) + 1) if f"{base}{k or ''}" not in ids)
        ids.add(uid)
        out.append(
            Mutant(
                id=uid,
                file=file,
                find=source[e.start : e.end].decode(),
                replace=e.replace,
                why=e.why,
                start=e.start,
                end=e.end,
                line=e.line,
                operator=f"{e.family}/{e.operator}",
                equivalent=original.equivalence(mutated),
            )
        )
    return out


def targets(spec: str, tree: Path, packages: tuple[str, ...]) -> list[str]:
    """The modules a ``--generate`` argument names: a module path, a folder, or a room's name."""
    p = Path(spec)
    if (tree / p).is_file() and p.suffix == ".py":
        return [p.as_posix()]
    for folder in [p] + [Path(pkg, spec) for pkg in packages]:
        if (tree / folder).is_dir() and folder.parts[0] in packages:
            return sorted(x.relative_to(tree).as_posix() for x in (tree / folder).rglob("*.py"))
    raise ValueError(
        f"--generate {spec!r}: not a module, a folder of {', '.join(packages)} or a room (e.g. plan, "
        "lab_utils/plan/from_trace.py, lab_kernels)"
    )
