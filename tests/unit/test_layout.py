"""The package's shape, read from its source: no import circle (function-level imports included), no import
that climbs a layer, no project module imported under an alias, no function over 80 lines (the C++
library's too, and the tests', benchmarks', scripts', recipe's and examples' Python), no module over 800
lines. Each rule has a twin on a synthetic tree showing that the check sees a violation."""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "true_on_policy"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800
# The package's floors, lowest first: a subpackage (or top-level module) imports only from its own floor or
# below. The pure core (kernels, config, contract) never reaches an engine adapter or the CLI.
LAYERS = (
    ("patching", "loss", "tiny_assets", "configs"),
    ("kernels",),
    ("config", "transformers_adapter"),
    ("contract", "rollout"),
    ("diagnose", "vllm_adapter"),
    ("verl_adapter", "cli"),
    ("__main__",),
)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, ast.Module]:
    return {_module_name(path, root): ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}


def _imported(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (``from a import b``: ``a.b`` where that
    is a module, else ``a``)."""
    package = name if any(other.startswith(name + ".") for other in known) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {module for module in found if module in known and module != name}


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of the project's import graph, as the modules along it (empty: none)."""
    trees = _modules(root)
    graph = {name: _imported(name, tree, set(trees)) for name, tree in trees.items()}
    circles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def _floor(module: str, layers) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else parts[0]
    for index, names in enumerate(layers):
        if room in names:
            return index
    raise AssertionError(f"{module}: {room} is on no floor of LAYERS (tests/unit/test_layout.py): place it")


def climbing_imports(root: Path, layers=LAYERS) -> list[str]:
    """Every import from a lower floor up to a higher one, as 'module -> module'."""
    trees = _modules(root)
    found = []
    for name, tree in trees.items():
        if name == root.name:
            continue
        for target in sorted(_imported(name, tree, set(trees))):
            if target != root.name and _floor(target, layers) > _floor(name, layers):
                found.append(f"{name} -> {target}")
    return sorted(found)


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{path.relative_to(root.parent)} ({count} lines)" for path in sorted(root.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > limit]


def aliased_project_imports(root: Path) -> list[str]:
    """``import project.module as x`` / ``from project import module as x``, as 'module.py:line'."""
    found = []
    top = root.name
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                relative = isinstance(node, ast.ImportFrom) and node.level > 0
                source = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
                for alias in node.names:
                    full = f"{source}.{alias.name}" if source else alias.name
                    if alias.asname and alias.asname != alias.name and (full.startswith(top + ".") or relative):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno} {full} as {alias.asname}")
    return found


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return found


def _cpp_code(text: str) -> str:
    """C++ source with its comments, string and character literals and preprocessor lines blanked (newlines
    kept, so offsets keep their line numbers)."""
    blank = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
                       re.DOTALL | re.MULTILINE)
    return blank.sub(lambda match: re.sub(r"[^\n]", " ", match.group()), text)


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """The function definitions of a C++ source outside any function body -- at namespace scope, or members
    defined in a class -- as (name, first line, last line): a brace whose head (the text since the last ``;``,
    ``{`` or ``}``) holds a call-like ``name(`` with no ``=`` before it, and is no namespace, class or struct."""
    code = _cpp_code(text)
    found, scopes, head_start = [], [], 0
    for at, char in enumerate(code):
        if char == ";":
            head_start = at + 1
        elif char == "{":
            head, head_start = code[head_start:at], at + 1
            before_call = head.split("(")[0]
            call = re.search(r"(~?[A-Za-z_]\w*)\s*\(", head)
            if any(kind != "scope" for kind, _ in scopes):
                scopes.append(("block", None))  # inside a function: its length counts it
            elif re.search(r"\b(namespace|struct|class|union|extern)\b", before_call):
                scopes.append(("scope", None))
            elif call is None or "=" in before_call:
                scopes.append(("block", None))  # an initializer
            else:
                scopes.append(("function", (call.group(1), code.count("\n", 0, at - len(head) + call.start(1)) + 1)))
        elif char == "}":
            kind, function = scopes.pop()
            if kind == "function":
                found.append((*function, code.count("\n", 0, at) + 1))
            head_start = at + 1
    return found


def long_cpp_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in sorted([*root.rglob("*.cpp"), *root.rglob("*.h")]):
        for name, first, last in cpp_functions(path.read_text()):
            if last - first + 1 > limit:
                found.append(f"{path.relative_to(root.parent)}:{first} {name} ({last - first + 1} lines)")
    return found


def test_the_package_has_no_import_circle():
    assert import_circles(PACKAGE) == []


def test_no_import_climbs_a_layer():
    assert climbing_imports(PACKAGE) == []


def test_every_package_module_sits_on_a_floor():
    for name in _modules(PACKAGE):
        if name != PACKAGE.name:
            _floor(name, LAYERS)


def test_no_package_module_is_over_800_lines():
    assert long_modules(PACKAGE) == []


def test_no_project_module_is_imported_under_an_alias():
    assert aliased_project_imports(PACKAGE) == []


# the folders of Python outside the package that import it; the 80-line rule is the whole repository's
OUTSIDE_ROOTS = ("benchmarks", "scripts", "examples", "recipe")


@pytest.mark.parametrize("folder", (PACKAGE.name, "tests", *OUTSIDE_ROOTS))
def test_no_function_in_the_repository_is_over_80_lines(folder):
    assert any((REPO / folder).rglob("*.py")), f"{folder}/ holds no Python: the rule checks nothing there"
    assert long_functions(REPO / folder) == []


def test_no_cpp_function_is_over_80_lines():
    assert long_cpp_functions(PACKAGE) == []


@pytest.fixture
def bad_tree(tmp_path) -> Path:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("from pkg.sub import b as bee\n")
    (root / "sub" / "b.py").write_text("def late():\n    from pkg import a\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    # C++: a long function inside a namespace, after a struct with a short member and braces in a comment,
    # a string and an initializer, none of which is a function of its own
    (root / "sub" / "c.cpp").write_text(
        "#include <vector>\nnamespace {\nstruct S {\n  int f() const { return 1; }  // }{\n};\n"
        "constexpr int kTable[] = {1, 2};\n}  // namespace\n"
        "int long_one(int n) {\n  const char* text = \"}\";\n" + "  n = n + 1;\n" * MAX_FUNCTION_LINES + "  return n;\n}\n"
    )
    return root


def test_the_checks_see_a_circle_an_alias_and_a_long_function(bad_tree):
    assert import_circles(bad_tree) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    assert aliased_project_imports(bad_tree) == ["pkg/a.py:1 pkg.sub.b as bee"]
    assert long_functions(bad_tree) == [f"pkg/sub/b.py:1 late ({MAX_FUNCTION_LINES + 2} lines)"]


def test_the_checks_see_a_climbing_import_and_a_long_module(bad_tree):
    assert climbing_imports(bad_tree, layers=(("sub",), ("a",))) == ["pkg.sub.b -> pkg.a"]
    (bad_tree / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(bad_tree) == [f"pkg/long.py ({MAX_MODULE_LINES + 1} lines)"]


def test_the_cpp_check_sees_a_long_function(bad_tree):
    assert long_cpp_functions(bad_tree) == [f"pkg/sub/c.cpp:8 long_one ({MAX_FUNCTION_LINES + 4} lines)"]
    assert [name for name, _, _ in cpp_functions((bad_tree / "sub" / "c.cpp").read_text())] == ["f", "long_one"]


def stale_project_imports(paths) -> list[str]:
    """Each ``from true_on_policy.X import name`` / ``import true_on_policy.X`` in ``paths`` (files outside the
    package that import it: benchmarks, scripts, examples, the recipe) that no longer resolves, as 'file:line'."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
                names = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [(alias.name, None) for alias in node.names if alias.name.startswith(PACKAGE.name)]
            else:
                continue
            for module, name in names:
                if not _resolves(module, name):
                    found.append(f"{path.name}:{node.lineno} {module}{'.' + name if name else ''}")
    return found


def _resolves(module: str, name: str | None) -> bool:
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return False
    if name is None or hasattr(imported, name):
        return True
    return importlib.util.find_spec(f"{module}.{name}") is not None


def test_every_project_import_outside_the_package_resolves():
    """A module moved inside the package must take its users outside it along (a benchmark once failed at
    import after kernels/model.py moved to the transformers adapter)."""
    outside = [path for d in OUTSIDE_ROOTS for path in sorted((REPO / d).rglob("*.py"))]
    assert outside and stale_project_imports(outside) == []


def test_twin_a_stale_import_is_named(tmp_path):
    stale = tmp_path / "bench_stale.py"
    stale.write_text("from true_on_policy.kernels.model import patch_transformers\nimport true_on_policy.kernels\n")
    assert stale_project_imports([stale]) == ["bench_stale.py:1 true_on_policy.kernels.model.patch_transformers"]


def helpers_imported_by_a_path(paths) -> list[str]:
    """Each import of a tests/support helper through its folder (``support.ports``), as 'file:line': a helper is
    imported by its bare name (tests/conftest.py), or it would be loaded twice, as two modules, under two names."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] == "support"]
    return found


def test_every_test_helper_is_imported_by_its_bare_name():
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert tests and helpers_imported_by_a_path(tests) == []


def test_twin_a_helper_imported_through_its_folder_is_named(tmp_path):
    test = tmp_path / "test_path.py"
    test.write_text("from ports import free_port\nfrom support.ports import free_port\nimport support.check_runs\n")
    assert helpers_imported_by_a_path([test]) == ["test_path.py:2 support.ports", "test_path.py:3 support.check_runs"]
