"""Install without the [mt] extra: torch, triton and numpy give the ops, the modules and the model;
a command line that needs the extra says in one line what to install and exits non-zero, and a
library import of a module that needs it raises ImportError with the same line.

The interpreters here run with the extra's packages blocked (a sitecustomize on PYTHONPATH installs
a sys.meta_path finder in place of Python's
PathFinder that does not find them), which is what a `pip install .` without [mt] sees."""

import os
import subprocess
import sys

import pytest

from fastattn._extras import MT_PACKAGES, MissingExtraError, missing_message

# Stands in for the PathFinder on sys.meta_path, which finds what is installed, and finds nothing
# of the blocked packages: to importlib (find_spec, import) they are not installed.
BLOCKER = f"""
import sys
from importlib.machinery import PathFinder

BLOCKED = {sorted(MT_PACKAGES.values())!r}


class NotInstalled(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
"""


@pytest.fixture(scope="module")
def without_mt(tmp_path_factory):
    """Runs python with `args` in an interpreter that cannot import the [mt] packages."""
    site = tmp_path_factory.mktemp("without_mt")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              timeout=300, cwd=site)

    return run


def test_ops_modules_and_model_import_without_mt_and_the_rest_names_it(without_mt):
    code = f"""
import sys, torch, fastattn, fastattn.ops
from fastattn import MultiHeadAttention, Transformer, TransformerConfig
Transformer(TransformerConfig(vocab_size=11, encoder_layers=1, decoder_layers=1, d_model=16,
                              d_ff=32, heads=2))
x = torch.randn(3, 2, 16)
assert MultiHeadAttention(16, 2)(x, x, x, need_weights=False)[0].shape == x.shape
print(sorted(set({sorted(MT_PACKAGES.values())!r}) & set(sys.modules)))
try:
    import sentencepiece
except ImportError:
    print("blocked")
# A library import of a module needing the extra names it (one subprocess: torch loads slowly).
try:
    import fastattn.data
except ImportError as e:
    print(type(e).__name__, isinstance(e, ImportError), e)
# The GPU self-check runs the trainer's update on a machine with torch and Triton alone.
import fastattn.tools.gpu_check
from fastattn.train import launch_step
try:
    from fastattn.train import Run
except ImportError as e:
    print(type(e).__name__, e)
"""
    result = without_mt("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[]", "blocked",
        "MissingExtraError True " + missing_message("fastattn.data", ["sentencepiece"]),
        "MissingExtraError " + missing_message("fastattn.data", ["sentencepiece"])]
    assert "pip install 'fastattn[mt]'" in result.stdout


# The commands whose entry checks the extra first (fastattn.cli.starting).
@pytest.mark.parametrize("command", ["train", "translate", "ensemble", "tools.evaluate",
                                     "tools.average"])
def test_command_says_what_to_install_in_one_line(without_mt, command):
    result = without_mt("-m", f"fastattn.{command}", "--help")
    assert result.returncode == 1
    missing = ", ".join(MT_PACKAGES)
    assert result.stderr == (f"error: fastattn.{command} needs the [mt] extra (missing: "
                             f"{missing}): pip install 'fastattn[mt]'\n")
    assert result.stdout == ""


def test_missing_extra_error_is_an_import_error_with_one_line():
    error = MissingExtraError("fastattn.data", ModuleNotFoundError("x", name="sentencepiece"))
    assert isinstance(error, ImportError) and error.name == "sentencepiece"
    assert str(error) == ("fastattn.data needs the [mt] extra (missing: sentencepiece): "
                          "pip install 'fastattn[mt]'")
