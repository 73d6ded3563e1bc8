"""FASTATTN_CPU_ISA: fastattn._C's CPU kernels held to an instruction-set level, and each level's
code within its instruction set (so that an AVX2 CPU never meets an AVX-512 instruction). The
kernels themselves run at every level in their own tests (the at_every_cpu_isa fixture)."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fastattn
from fastattn._native import CPU_ISA_LEVELS, set_cpu_isa, supported_cpu_isas

pytestmark = pytest.mark.skipif(fastattn.native is None, reason="fastattn._C is not built")


def in_subprocess(code: str, level: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTATTN_CPU_ISA=level)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("level", CPU_ISA_LEVELS)
def test_the_environment_holds_the_level_at_load(level):
    out = in_subprocess("import fastattn; print(fastattn.cpu_isa())", level)
    assert out.returncode == 0, out.stderr
    best = torch.ops.fastattn.supported_cpu_isa()  # the CPU's, whatever holds this process
    expected = CPU_ISA_LEVELS[min(CPU_ISA_LEVELS.index(level), CPU_ISA_LEVELS.index(best))]
    assert out.stdout.strip() == expected


def test_an_unknown_level_is_named():
    out = in_subprocess("import fastattn._native", "avx3")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: FASTATTN_CPU_ISA: unknown instruction-set level 'avx3'; expected one of "
        "amx, avx512, avx2, scalar")
    with pytest.raises(ValueError, match="unknown instruction-set level 'AVX2'"):
        set_cpu_isa("AVX2")


def test_set_cpu_isa_holds_lower_and_never_above_the_cpu():
    before = fastattn.cpu_isa()
    try:
        for level in CPU_ISA_LEVELS:
            got = set_cpu_isa(level)
            assert got == fastattn.cpu_isa()
            assert got == (level if level in supported_cpu_isas() else supported_cpu_isas()[-1])
    finally:
        set_cpu_isa(before)


def test_the_environment_holds_set_cpu_isa_too():
    """FASTATTN_CPU_ISA=scalar is a hold for the process: set_cpu_isa cannot go above it."""
    out = in_subprocess("import fastattn\nfrom fastattn._native import supported_cpu_isas\n"
                        "print(fastattn.set_cpu_isa('avx512'), supported_cpu_isas())", "scalar")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "('scalar',)"]


def test_info_names_the_level():
    out = in_subprocess("from fastattn.tools import info; print(info.report())", "scalar")
    assert out.returncode == 0, out.stderr
    assert "cpu isa (FASTATTN_CPU_ISA)  scalar (this CPU's best: " in out.stdout
    assert "int8 kernel scalar, bf16 kernel scalar" in out.stdout


# Instructions beyond each level: AVX-512's registers and masks above AVX2; any 256-bit register
# above the baseline (x86-64's SSE2).
BEYOND = {"avx2": re.compile(r"%zmm|%k[0-7]\b|\{%k"), "scalar": re.compile(r"%[yz]mm")}


@pytest.mark.skipif(shutil.which("objdump") is None or not sys.platform.startswith("linux"),
                    reason="needs binutils' objdump to read the extension's code")
def test_each_levels_functions_stay_within_its_instruction_set():
    """Every function compiled for a level (FASTATTN_PER_ISA's name_avx2 and name_scalar, and the
    hand-made ones named so) holds no instruction of a higher level."""
    command = ["objdump", "-d", "--no-show-raw-insn", "-C", fastattn.native.__file__]
    listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    seen = {level: 0 for level in BEYOND}
    offenders = []
    for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        name = function.split("\n", 1)[0]
        for level, beyond in BEYOND.items():
            if re.search(rf"_{level}\b|_{level}<", name):
                seen[level] += 1
                if beyond.search(function):
                    offenders.append(f"{level}: {name[:160]}")
    assert not offenders, offenders
    assert all(seen.values()), seen  # the names are still there to check
