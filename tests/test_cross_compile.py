"""scripts/cross_compile.py: fastattn._C builds for aarch64 (the whole build is a sweep, ./run test
-m sweep: a minute on 2 cores), and its undefined-function check finds a fastattn function that
only an x86 guard defines."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import cross_compile

TARGET = "aarch64-linux-gnu"
needs_cross_compiler = pytest.mark.skipif(
    shutil.which(f"{TARGET}-g++") is None,
    reason=f"{TARGET}-g++ is not installed (Debian: g++-{TARGET})")


@needs_cross_compiler
def test_a_function_defined_only_under_an_x86_guard_is_found(tmp_path):
    source = tmp_path / "guarded.cpp"
    source.write_text("namespace fastattn {\nint pick();\n"
                      "#ifdef __x86_64__\nint pick() { return 2; }\n#endif\n"
                      "int dispatch() { return pick(); }\n}  // namespace fastattn\n")
    library = tmp_path / "guarded.so"
    subprocess.run([f"{TARGET}-g++", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True)
    assert cross_compile.undefined_fastattn_symbols(f"{TARGET}-nm", library) == [
        "fastattn::pick()"]


@needs_cross_compiler
@pytest.mark.sweep
def test_the_extension_cross_compiles_for_aarch64():
    done = subprocess.run([sys.executable, "-m", "scripts.cross_compile", "--target", TARGET],
                          capture_output=True, text=True, timeout=1800,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
