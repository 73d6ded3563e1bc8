"""The package: the extension, the warning without it, the backend switch, the Triton range, no
import cycle among its modules, and the command lines' short usage on a bad flag."""

import ast
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

import fastattn
from fastattn import backend

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_extension_is_built_and_loaded():
    from fastattn import _C

    assert fastattn.native is _C


def test_import_without_extension_warns_once_naming_the_fallback():
    code = """
import sys, warnings
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "fastattn._C":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastattn
    import fastattn.ops
messages = [str(w.message) for w in caught if "fastattn._C" in str(w.message)]
assert fastattn.native is None
print(len(messages)); print(messages[0])
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    count, message = out.stdout.splitlines()[:2]
    assert count == "1"
    assert "beam search" in message and "Python" in message


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        fastattn.set_backend("cuda")
    out = run_python("import fastattn.ops", FASTATTN_BACKEND="fast")
    assert out.returncode != 0
    assert "backend must be one of ('auto', 'triton', 'torch'), got 'fast'" in out.stderr


def test_set_backend_round_trip():
    before = fastattn.get_backend()
    try:
        for name in backend.BACKENDS:
            fastattn.set_backend(name)
            assert fastattn.get_backend() == name
    finally:
        fastattn.set_backend(before)


def test_triton_outside_supported_range_is_named(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "2.1.0")
    expected = "triton 2.1.0 is not supported: fastattn needs triton>=3.6,<3.10"
    assert backend._check_triton() == expected
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert backend._check_triton() is None


def test_triton_backend_on_cpu_needs_the_interpreter():
    code = """
import torch, fastattn
from fastattn import backend
fastattn.set_backend("triton")
try:
    backend.implementation("attention", "cpu", torch.float32)
except RuntimeError as e:
    print(e)
"""
    env = {"TRITON_INTERPRET": "0", "FASTATTN_BACKEND": "auto"}
    out = run_python(code, **env)
    assert "needs Triton's interpreter: set TRITON_INTERPRET=1" in out.stdout, out.stderr


# The packages the import graph covers, as installed (pyproject.toml's package-dir), and the
# compiled extension, a module with no Python source (csrc/).
PACKAGES = {"fastattn": REPO / "fastattn", "fastattn.kernels": REPO / "kernels"}
EXTENSIONS = {"fastattn._C"}


def package_modules() -> dict[str, Path]:
    """Every Python module of PACKAGES by its dotted name (a package by its __init__.py)."""
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((prefix, *parts[:-1 if parts[-1] == "__init__" else None]))] = path
    return found


def module_imports(name: str, path: Path, modules: set[str]) -> dict[str, int]:
    """The modules of `modules` that module `name` imports, each with the line of its first
    import: every import statement, at the top, inside functions, under `if TYPE_CHECKING:` or
    `if __name__ == "__main__":` alike, relative ones resolved. `from fastattn import ops` imports
    the module fastattn.ops; `from fastattn.model import Transformer` the module fastattn.model
    (the parent package's __init__, which Python runs first, is no edge: importing the kernels
    runs only a light one, test_kernels_import_no_other_fastattn_module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import z
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *filter(None, [base])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import a.b.c where a.b is the module
                target = target.rpartition(".")[0]
            if target and target != name:
                imported[target] = min(imported.get(target, node.lineno), node.lineno)
    return imported


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The cycles a depth-first walk of the graph closes (one per import that leads back to a
    module on the walk's path), each as the modules along it; none if and only if the graph has
    no cycle."""
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path, pending = [start], {start: iter(sorted(graph[start]))}
        while path:  # depth first; a module met again on the path closes a cycle
            following = next(pending[path[-1]], None)
            if following is None:
                done.add(path.pop())
            elif following in path:
                cycles.append(path[path.index(following):] + [following])
            elif following not in done:
                path.append(following)
                pending[following] = iter(sorted(graph[following]))
    return cycles


def test_no_import_cycle_in_fastattn_and_kernels():
    paths = package_modules()
    modules = set(paths) | EXTENSIONS
    graph = {name: module_imports(name, path, modules) for name, path in paths.items()}
    graph.update({name: {} for name in EXTENSIONS})
    cycles = [" -> ".join(f"{module} (line {graph[module][following]})"
                          for module, following in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"
              for cycle in import_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_model_imports_nothing_from_the_inference_wing():
    # The paper's model knows nothing of decoding: no import of fastattn.inference, at the top,
    # inside a function or under TYPE_CHECKING, directly or through the modules it imports.
    paths = package_modules()
    modules = set(paths) | EXTENSIONS
    graph = {name: module_imports(name, path, modules) for name, path in paths.items()}
    graph.update({name: {} for name in EXTENSIONS})
    direct = sorted(graph["fastattn.model"])
    reached, pending = set(), ["fastattn.model"]
    while pending:
        for module in graph[pending.pop()]:
            if module not in reached:
                reached.add(module)
                pending.append(module)
    wing = sorted(m for m in reached if m == "fastattn.inference"
                  or m.startswith("fastattn.inference."))
    assert "fastattn.inference.decoder" in graph  # the wing is there, and imports the model
    assert "fastattn.model" in graph["fastattn.inference.decoder"]
    assert wing == [], f"fastattn.model imports {direct}, which reach {wing}"


def test_the_readme_map_names_every_module_and_nothing_that_is_not_there():
    """README's architecture map names each module and package of fastattn/ and kernels/ (a
    sub-package's modules by their names), and every file or folder it names exists."""
    block = (REPO / "README.md").read_text().split("## Architecture", 1)[1].split("```")[1]
    words = set(re.findall(r"\w+", block))
    unnamed = sorted(
        str(path.relative_to(REPO)) for folder in PACKAGES.values() for path in folder.rglob("*")
        if "__pycache__" not in path.parts and (
            path.suffix == ".py" and path.stem not in ("__init__", "__main__")
            or path.is_dir() and (path / "__init__.py").exists())
        and path.stem not in words)
    assert not unnamed, f"README's map does not name {unnamed}"
    files = set()
    for _, folders, names in os.walk(REPO):
        folders[:] = [f for f in folders if not f.startswith(".") and f != "build"]
        files.update(folders, names)
    named = re.findall(r"[\w.]+\.(?:py|sh|json)\b|\w+/(?=[\s,)]|$)", block)  # files, folders/
    missing = sorted(name for name in named if name.rstrip("/") not in files)
    assert not missing, f"README's map names {missing}, which do not exist"


def test_no_library_module_imports_the_tools():
    # The tools (fastattn.tools: python -m fastattn.tools.NAME) depend on library modules, never
    # the reverse: outside fastattn/tools/ no module imports one, at the top, inside a function or
    # under TYPE_CHECKING (fastattn.bleu, not the evaluate command, scores BLEU for the trainer).
    paths = package_modules()
    modules = set(paths) | EXTENSIONS
    graph = {name: module_imports(name, path, modules) for name, path in paths.items()}
    tools = {m for m in graph if m == "fastattn.tools" or m.startswith("fastattn.tools.")}
    assert {"fastattn.tools.evaluate", "fastattn.tools.gpu_check", "fastattn.tools.info"} <= tools
    assert "fastattn.bleu" in graph["fastattn.tools.evaluate"]  # the graph sees the tools' imports
    importers = sorted(f"{module} (line {line}) imports {target}"
                       for module, imported in graph.items() if module not in tools
                       for target, line in imported.items() if target in tools)
    assert importers == []


def test_the_import_graph_sees_every_kind_of_import(tmp_path):
    # The graph test passes only if module_imports misses nothing: each form an import takes.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.b import B\n"
        "def f():\n    from . import c\n"
        "if __name__ == '__main__':\n    import pkg.d.e\n"
        "from .d import e as x\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.d.e"}
    assert module_imports("pkg.a", package / "a.py", modules) == {
        "pkg.b": 3, "pkg.c": 5, "pkg.d.e": 7}
    graph = {"pkg.a": {"pkg.b": 1}, "pkg.b": {"pkg.c": 1}, "pkg.c": {"pkg.a": 1, "pkg.d": 1},
             "pkg.d": {}}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


@pytest.mark.parametrize("command", ["fastattn.train", "fastattn.translate",
                                     "fastattn.tools.evaluate", "fastattn.tools.average",
                                     "fastattn.ensemble", "fastattn.tools.ctranslate2_convert",
                                     "fastattn.tools.info"])
def test_a_bad_flag_is_a_short_usage_line_and_the_error(command):
    result = subprocess.run([sys.executable, "-m", command, "--no-such-flag"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3, result.stderr  # not the page-long usage of every flag
    assert lines[0].startswith(f"usage: python -m {command}")
    assert lines[-1].startswith(f"python -m {command}: error: ")


# The commands whose entry catches Ctrl-C while it imports (fastattn.cli.starting).
STARTING = ["fastattn.train", "fastattn.translate", "fastattn.ensemble", "fastattn.tools.evaluate",
            "fastattn.tools.average"]


@pytest.mark.parametrize("command", STARTING)
def test_ctrl_c_while_a_command_imports_torch_is_one_line(command):
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    # torch's library is mapped early in `import torch`, which the command's entry starts after
    # installing its handler; the rest of the import takes seconds.
    while "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert stderr.strip() == "interrupted" and stdout == ""


def test_importing_fastattn_loads_nothing_and_installs_no_handler():
    # The commands' entries, not the package, catch Ctrl-C and check the [mt] extra: `import
    # fastattn` (which `python -m fastattn.X` runs first) has no such side effect.
    code = """
import signal, sys
sys.argv[0] = "-m"  # what the package saw while `python -m` imported it
import fastattn
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print(sorted(m for m in sys.modules if m.startswith("fastattn")), "torch" in sys.modules)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True", "['fastattn'] False"]
    mentions = [str(path.relative_to(REPO)) for folder in PACKAGES.values()
                for path in folder.rglob("*.py") if "orig_argv" in path.read_text()]
    assert mentions == []


def test_kernels_import_no_other_fastattn_module():
    code = ("import fastattn.kernels.attention, fastattn.kernels.cross_entropy, "
            "fastattn.kernels.embedding, fastattn.kernels.relu, fastattn.kernels.compile_report, "
            "sys; print(sorted(m for m in sys.modules if m.startswith('fastattn')))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)
    assert "fastattn.kernels.attention" in loaded
    assert [m for m in loaded if m != "fastattn" and not m.startswith("fastattn.kernels")] == []


def test_the_public_api_is_there_on_first_use():
    code = """
import fastattn
for name in fastattn.__all__:
    getattr(fastattn, name)
print(fastattn.Transformer.__module__, fastattn.ops.__name__, fastattn.Translator.__module__,
      fastattn.Ensemble.__module__, fastattn.native is not None, fastattn.cpu_isa())
try:
    fastattn.no_such_name
except AttributeError as e:
    print(e)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    first, error = out.stdout.splitlines()
    assert first.split()[:5] == ["fastattn.model", "fastattn.ops", "fastattn.inference.translator",
                                 "fastattn.inference.ensemble", "True"]
    assert error == "module 'fastattn' has no attribute 'no_such_name'"


def test_every_script_runs_its_command():
    # pyproject.toml's [project.scripts] table, NAME = "MODULE:FUNCTION" a line (tomllib needs
    # Python 3.11).
    table = (REPO / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n[")[0]
    scripts = dict(line.replace('"', "").split(" = ") for line in table.splitlines()
                   if " = " in line)
    assert "fastattn-translate" in scripts
    # A bad flag: each command's parser answers with its usage and status 2, so the entry reached
    # the command's main (one process: torch loads slowly).
    code = f"""
import importlib, sys
for name, target in {sorted(scripts.items())!r}:
    module, function = target.split(":")
    sys.argv = [name, "--no-such-flag"]
    try:
        getattr(importlib.import_module(module), function)()
    except SystemExit as e:
        print(name, e.code, flush=True)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{name} 2" for name in sorted(scripts)]
    for name, target in scripts.items():  # fastattn-info runs python -m fastattn.tools.info
        module = target.split(":")[0].removesuffix(".__main__")
        assert f"usage: python -m {module}" in out.stderr, name
