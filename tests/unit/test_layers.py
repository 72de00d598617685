"""The package's layering holds, as its folders show it (and pipeq's docstring draws it).

    control plane   control/ (runner, backends), launch/ (pipeq launch), trace/report, trace/plot, trace/critical
    event loop      runtime/: a stage process's event loop and the simulated engine run its actions
    compute         schedules/ (pure), stage/, research/, parallel/, checkpoint/, models/, trace/format
    transport       wire/: sockets, links, shared memory, lanes
    codec           wire/codec, wire/messages, wire/keys, wire/netif, errors, tree

A module may import modules of its own layer or below (lazy imports inside functions count too).
Beside the direction of imports: the research schedules are plug-ins (nothing outside research/
names them), only the wire layer uses the codec, schedules are pure, and no module, class or
function outgrows its job. docs/architecture.md lists every module under its layer (see
page_rows for how the page names one).
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pipeq

PACKAGE = os.path.dirname(pipeq.__file__)

#: Each layer's modules, by dotted name under pipeq: a name ending in "." is a whole folder.
#: The first pattern that matches a module decides its layer (longest patterns first).
LAYERS: dict[str, list[str]] = {
    "control plane": ["__init__", "__main__", "control.", "launch.", "trace.report", "trace.plot", "trace.advice",
                      "trace.critical"],
    "event loop": ["runtime."],
    "compute": ["schedules.", "stage.", "research.", "parallel.", "checkpoint.", "models.", "trace.__init__",
                "trace.format", "balance", "testing", "split.", "compat"],
    "transport": ["wire."],
    "codec": ["wire.codec", "wire.messages", "wire.fields", "wire.keys", "wire.netif", "wire.control", "errors", "tree", "lazy"],
}
#: Modules that do no I/O: they import nothing but each other and the standard library's pure parts.
PURE = ("schedules.", "errors", "lazy")
#: The only modules that may name the research schedules and their layer types.
RESEARCH = "research."
RESEARCH_NAMES = {"Interlock", "AsyncOneFOneB", "AssociatedLearning", "ALLayer"}
#: Size limits (lines) beyond which a seam is missing, and the places allowed past them (with why).
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 300, 80
ALLOWED_LONG: dict[str, str] = {}
#: Classes assembled from several pipeq classes as bases (mixins sharing private state), each with
#: why it is still one; a class split to meet the sizes gets collaborators instead (see below).
MIXED: dict[str, str] = {}


def modules() -> list[str]:
    """Every module of the package, as a dotted name under pipeq ("wire.codec", "trace.__init__")."""
    out = []
    for root, _, files in os.walk(PACKAGE):
        rel = os.path.relpath(root, PACKAGE)
        prefix = "" if rel == "." else rel.replace(os.sep, ".") + "."
        out += [prefix + f[:-3] for f in files if f.endswith(".py")]
    return sorted(out)


def path_of(module: str) -> str:
    return os.path.join(PACKAGE, *module.split(".")) + ".py"


@functools.lru_cache(maxsize=None)
def source_of(module: str) -> str:
    """``module``'s source, read once per run (every check here reads every module)."""
    with open(path_of(module)) as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def tree_of(module: str) -> ast.Module:
    """``module``'s syntax tree, parsed once per run (the checks only read it)."""
    return ast.parse(source_of(module))


def _matches(module: str, pattern: str) -> bool:
    return module.startswith(pattern) if pattern.endswith(".") else module == pattern


def layer_of(module: str) -> str | None:
    best: tuple[int, str] | None = None
    for layer, patterns in LAYERS.items():
        for p in patterns:
            if _matches(module, p) and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return best[1] if best else None


RANK = {layer: i for i, layer in enumerate(LAYERS)}


def _resolve(name: str, known: set[str]) -> str | None:
    """The module a dotted name under pipeq refers to: itself, its package's __init__, or the
    module an attribute belongs to ("wire.codec.encode" -> "wire.codec")."""
    parts = name.split(".") if name else []
    while parts:
        dotted = ".".join(parts)
        if dotted in known:
            return dotted
        if dotted + ".__init__" in known:
            return dotted + ".__init__"
        parts.pop()
    return "__init__"


def imports(module: str) -> set[str]:
    """The pipeq modules ``module`` imports, anywhere in its source (relative imports too)."""
    return set(_imports(module))


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> frozenset[str]:
    known = set(modules())
    tree = tree_of(module)
    package = module.split(".")[:-1]
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: no import at run time
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "pipeq" or node.module.startswith("pipeq.")):
                mod = node.module[6:]
            else:
                continue
            for a in node.names:  # "from pipeq.wire import codec" imports the module codec
                sub = f"{mod}.{a.name}" if mod else a.name
                target = _resolve(sub, known) if (sub in known or sub + ".__init__" in known) else _resolve(mod, known)
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(_resolve(a.name[6:], known) for a in node.names if a.name.startswith("pipeq."))
    out.discard(module)
    return frozenset(m for m in out if m is not None)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == [], "add new folders or modules to LAYERS"


def test_imports_point_down_only():
    upward = [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
              for m in modules() for d in sorted(imports(m))
              if RANK[layer_of(d)] < RANK[layer_of(m)] and not _package_front(m, d)]
    assert upward == []


def _package_front(module: str, dep: str) -> bool:
    """A package's __init__ may re-export what its own modules define."""
    return module.endswith("__init__") and dep.startswith(module[: -len("__init__")])


def test_no_import_cycles():
    graph = {m: imports(m) for m in modules()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            cycle = path[path.index(m):] + [m]
            if not all(x.endswith("__init__") for x in cycle[:1]):
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            return
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        if m != "__init__":
            visit(m, [])


def test_only_the_wire_uses_the_codec():
    users = sorted(m for m in modules() if "wire.codec" in imports(m))
    assert users and all(m.startswith("wire.") for m in users), users
    assert not [m for m in modules() if not m.startswith("wire.") and _imports_zmq(m)]


def _imports_zmq(module: str) -> bool:
    tree = tree_of(module)
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "zmq" for a in n.names)
               or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "zmq"
               for n in ast.walk(tree))


def test_schedules_are_pure():
    pure = [m for m in modules() if any(_matches(m, p) for p in PURE)]
    for m in pure:
        impure = sorted(d for d in imports(m) if d not in pure)
        assert impure == [], f"{m} imports {impure}"
        tree = tree_of(m)
        third = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not third & {"torch", "zmq", "numpy", "msgpack"}, f"{m} imports {sorted(third)}"


def _names(module: str) -> set[str]:
    """The identifiers a module's code uses (names, attributes, imported names): not its prose."""
    tree = tree_of(module)
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update(a.asname or a.name.split(".")[-1] for a in n.names)
        elif isinstance(n, ast.ClassDef):
            out.add(n.name)
    return out


def test_only_research_names_the_research_schedules():
    named = {m: sorted(_names(m) & RESEARCH_NAMES) for m in modules() if not m.startswith(RESEARCH)}
    assert {m: n for m, n in named.items() if n} == {}


@functools.lru_cache(maxsize=None)
def code_lines(module: str) -> frozenset[int]:
    """The lines of ``module`` that hold code: not blank, not only a comment, not part of a
    docstring (a module's, class's or function's first statement when it is a string)."""
    import io
    import tokenize

    docs: set[int] = set()
    for node in ast.walk(tree_of(module)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
            tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source_of(module)).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return frozenset(lines - docs)


def logical_size(module: str, node: ast.AST | None = None) -> int:
    """How many lines of code ``node`` (default: the whole module) spans: docstrings, comments
    and blank lines do not count (what a reader has to read as code)."""
    lines = code_lines(module)
    if node is None:
        return len(lines)
    return sum(1 for n in range(node.lineno, node.end_lineno + 1) if n in lines)  # type: ignore[attr-defined]


def test_nothing_outgrows_its_job():
    """The size rule counts logical lines (:func:`logical_size`): a module's, a class's or a
    function's docstring says what it is for, and never counts against it."""
    long = []
    for m in modules():
        if logical_size(m) > MAX_MODULE:
            long.append(f"{m}: {logical_size(m)} lines")
        for node in ast.walk(tree_of(m)):
            if isinstance(node, ast.ClassDef) and logical_size(m, node) > MAX_CLASS:
                long.append(f"{m}:{node.name}: class of {logical_size(m, node)} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and logical_size(m, node) > MAX_FUNCTION:
                long.append(f"{m}:{node.name}: function of {logical_size(m, node)} lines")
    assert [x for x in long if x.split(":")[0] + ":" + x.split(":")[1].split(" ")[0] not in ALLOWED_LONG
            and x.split(":")[0] not in ALLOWED_LONG] == []


def _classes() -> dict[str, ast.ClassDef]:
    """Every class of the package, as "module:Name"."""
    return {f"{m}:{n.name}": n for m in modules() for n in ast.walk(ast.parse(open(path_of(m)).read()))
            if isinstance(n, ast.ClassDef)}


def test_no_class_is_assembled_from_mixins():
    """A class is one object with one job: none derives from a mixin, and none from several of
    pipeq's own classes (parts sharing its private state); a big job gets collaborators the class
    holds and calls through their small interfaces (the runner's: pipeq.control.pipeline, which
    holds the backend and hands it to lifecycle, feed, streaming, state and snapshots)."""
    classes = _classes()
    ours = {key.split(":")[1] for key in classes}
    mixins, mixed = [], []
    for key, node in classes.items():
        bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
        mixins += [f"{key}({b})" for b in bases if b.endswith("Mixin")]
        if len([b for b in bases if b in ours]) > 1 and key not in MIXED:
            mixed.append(f"{key}({', '.join(bases)})")
    assert mixins == [] and mixed == []
    still = [key for key in MIXED if key in classes and len([b for b in classes[key].bases
                                                             if ast.unparse(b).split(".")[-1] in ours]) > 1]
    assert sorted(still) == sorted(MIXED), "a class named in MIXED is no longer mixed: remove its entry"
    runner = classes["control.runner:PipelineRunner"]
    assert runner.bases == [], "the runner is one class: its parts are collaborators, not bases"


def test_the_runner_constructor_is_short():
    tree = tree_of("control.runner")
    init = next(n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "PipelineRunner"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    body = init.body[1:] if isinstance(init.body[0], ast.Expr) else init.body  # past a docstring
    assert body[-1].end_lineno - body[0].lineno + 1 < 40


def test_every_module_has_a_docstring_line():
    missing = [m for m in modules() if not ast.get_docstring(tree_of(m))]
    assert missing == []


def test_the_package_docstring_maps_every_folder_and_module():
    doc = pipeq.__doc__ or ""
    folders = sorted({m.split(".")[0] for m in modules() if "." in m})
    top = sorted(m for m in modules() if "." not in m and not m.startswith("_"))
    assert [f for f in folders if f + "/" not in doc] == []
    assert [m for m in top if m + ".py" not in doc] == []


#: The architecture page: its "Every module" section lists each module under its layer.
ROOT = os.path.dirname(PACKAGE)
PAGE = os.path.join(ROOT, "docs", "architecture.md")
_ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|")
_PATH = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py)`")


def page_rows(text: str) -> list[tuple[str, str | None]]:
    """The modules a page lists, in order, as (dotted name under pipeq, layer). A module is named
    by a table row of the page's "## Every module" section whose first cell is its path relative
    to pipeq/ in backticks (`wire/inbox.py`, `launch/job/keys.py`, `balance.py`, a package as
    `wire/__init__.py`); its layer is the "### " heading it stands under (lower case: "event
    loop"), None before the first one. Rows elsewhere on the page (the layers table) name folders,
    not modules, and do not count."""
    rows: list[tuple[str, str | None]] = []
    inside, layer = False, None
    for line in text.splitlines():
        if line.startswith("## "):
            inside, layer = line[3:].strip().lower() == "every module", None
        elif inside and line.startswith("### "):
            layer = line[4:].strip().lower()
        elif inside and (m := _ROW.match(line)):
            rows.append((m.group(1)[:-3].replace("/", "."), layer))
    return rows


def page_problems(text: str, known: list[str]) -> list[str]:
    """What a page gets wrong about the modules ``known``: each missing one, each row naming one
    that does not exist (stale), listed twice, or under another layer than :func:`layer_of`'s;
    and each `path.py` the page writes anywhere, in a row or its prose, that names no module
    (:func:`_exists`)."""
    rows = page_rows(text)
    listed = [m for m, _ in rows]
    out = [f"missing ({layer_of(m)}): {_path(m)}" for m in known if m not in listed]
    out += [f"stale: {_path(m)}" for m in dict.fromkeys(listed) if m not in known]
    out += [f"listed twice: {_path(m)}" for m in dict.fromkeys(listed) if listed.count(m) > 1]
    out += [f"under {layer!r}, not {layer_of(m)!r}: {_path(m)}" for m, layer in rows
            if m in known and layer != layer_of(m)]
    out += [f"stale path: {path}" for path in dict.fromkeys(_PATH.findall(text))
            if path not in map(_path, listed) and not _exists(path, known)]
    return out


def _path(module: str) -> str:
    """A module's path under pipeq/, as the page writes it: "wire.inbox" -> "wire/inbox.py"."""
    return module.replace(".", "/") + ".py"


def _exists(path: str, known: list[str]) -> bool:
    """Whether ``path`` (`x/y.py`) names a module of ``known``, as the end of its path under
    pipeq/ (`job/keys.py`, `keys.py`, `pipeq/launch/job/keys.py`), or a file of the repository."""
    under = path[len("pipeq/"):] if path.startswith("pipeq/") else path
    return (any(f"/{_path(m)}".endswith("/" + under) for m in known)
            or os.path.isfile(os.path.join(ROOT, path)))


def test_the_architecture_page_lists_every_module_under_its_layer():
    """docs/architecture.md names every module of pipeq/ (see :func:`page_rows`) and nothing
    that is not one. A new module gets a row under its layer: `folder/module.py` | its one job."""
    with open(PAGE, encoding="utf-8") as f:
        problems = page_problems(f.read(), modules())
    assert problems == [], "docs/architecture.md, section 'Every module':\n" + "\n".join(problems)


def test_the_page_check_finds_a_missing_a_stale_and_a_misplaced_module():
    page = ("## The layers\n| `pipeq/wire/` | `codec.py` |\n## Every module\n### Transport\n"
            "| module | its job |\n|---|---|\n| `wire/inbox.py` | the inbox |\n| `wire/gone.py` | a gone one |\n"
            "| `errors.py` | exceptions |\n### Codec\n| `wire/codec.py` | bytes (`wire/old.py`) |\n")
    assert page_rows(page) == [("wire.inbox", "transport"), ("wire.gone", "transport"), ("errors", "transport"),
                               ("wire.codec", "codec")]
    assert page_problems(page, ["errors", "wire.codec", "wire.inbox", "wire.queues"]) == [
        "missing (transport): wire/queues.py", "stale: wire/gone.py", "under 'transport', not 'codec': errors.py",
        "stale path: wire/old.py"]


def test_the_package_fronts_name_only_modules_that_exist():
    """A `name.py` a package's docstring writes (pipeq's map of its folders, each folder's map) is
    a module of pipeq (see :func:`_exists`)."""
    known = modules()
    stale = [f"{front}: {p}" for front in known if front.endswith("__init__")
             for p in dict.fromkeys(re.findall(r"\b(?:\w+/)*\w+\.py\b", ast.get_docstring(
                 ast.parse(open(path_of(front)).read())) or "")) if not _exists(p, known)]
    assert stale == [], "a package's docstring names a module that does not exist:\n" + "\n".join(stale)


#: Package fronts whose docstring maps every module of its folder (as `name.py`): the folders a
#: newcomer reads the code of first. (The others name their parts in prose; docs/architecture.md
#: lists every module.)
MAPPED = ("control.__init__", "runtime.__init__", "stage.__init__", "parallel.__init__", "schedules.__init__",
          "wire.__init__")


def test_the_folder_maps_name_every_module_of_their_folder():
    missing = []
    for front in MAPPED:
        folder = front[: -len("__init__")]
        doc = ast.get_docstring(ast.parse(open(path_of(front)).read())) or ""
        missing += [f"{front}: {m[len(folder):]}.py" for m in modules() if m.startswith(folder)
                    and m.count(".") == folder.count(".") and not m.endswith("__init__")
                    and not re.search(rf"(?<![\w/]){re.escape(m[len(folder):])}\.py\b", doc)]
    assert missing == [], "add each to its package's docstring:\n" + "\n".join(missing)
