"""The package: the extension, the warning without it, the backend switch, the Triton range, no
import cycle among its modules, and the command lines' short usage on a bad flag."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import triton

import fastattn
from fastattn import backend


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

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
    out = run_python("import fastattn", FASTATTN_BACKEND="fast")
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
    backend.use_triton(torch.zeros(1))
except RuntimeError as e:
    print(e)
"""
    env = {"TRITON_INTERPRET": "0", "FASTATTN_BACKEND": "auto"}
    out = run_python(code, **env)
    assert "needs Triton's interpreter: set TRITON_INTERPRET=1" in out.stdout, out.stderr


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The fastattn modules a module imports when it is imported: its top-level statements only
    (imports inside functions, `if TYPE_CHECKING:` or `if __name__ == "__main__":` run later or
    never). `from fastattn import ops` imports the module fastattn.ops."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in modules else node.module)
    return imported & modules


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_among_fastattn_modules():
    package = Path(fastattn.__file__).parent
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {name: module_imports(path, set(paths)) for name, path in paths.items()}
    done, path = set(), []

    def visit(module: str) -> None:  # depth first; a module met again on the path is a cycle
        if module in path:
            raise AssertionError(" -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("command", ["fastattn.train", "fastattn.translate", "fastattn.evaluate",
                                     "fastattn.average", "fastattn.ensemble",
                                     "fastattn.ctranslate2_convert", "fastattn.info"])
def test_a_bad_flag_is_a_short_usage_line_and_the_error(command):
    result = subprocess.run([sys.executable, "-m", command, "--no-such-flag"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3, result.stderr  # not the page-long usage of every flag
    assert lines[0].startswith(f"usage: python -m {command}")
    assert lines[-1].startswith(f"python -m {command}: error: ")


def test_ctrl_c_while_a_command_imports_torch_is_one_line():
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "fastattn.info"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    # torch's library is mapped early in `import torch`, which fastattn/__init__.py starts after
    # installing its handler; the rest of the import takes seconds.
    while "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert stderr.strip() == "interrupted" and stdout == ""
