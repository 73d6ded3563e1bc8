"""Cross-compiles fastattn._C's C++ sources for another CPU (default aarch64) with a GNU cross
compiler against this machine's torch headers, links them into one shared library and checks
that it leaves no fastattn function undefined: the portable code paths build there, and no
x86 intrinsic sits outside the files' x86 guards (cpu_isa.h's FASTATTN_X86).

    python -m scripts.cross_compile [--target aarch64-linux-gnu] [--jobs N]

Exit 0 when every source compiles and links; 1 with the compiler's first error otherwise; 2 when
the cross compiler is not installed (Debian: g++-aarch64-linux-gnu). Linking the real libtorch
of that CPU, and running the tests there, need that CPU (or an emulator) and are not done here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from torch.utils.cpp_extension import include_paths

REPO = Path(__file__).resolve().parent.parent
# setup.py's flags but -O2 (a check, not a release build) and -fPIC for the shared library.
FLAGS = ["-O2", "-std=c++17", "-fno-trapping-math", "-g0", "-fopenmp", "-fPIC",
         "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-w"]


def compile_one(compiler: str, source: Path, out: Path) -> tuple[Path, str | None]:
    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    done = subprocess.run([compiler, *FLAGS, *includes, "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        return source, None
    first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr)
    return source, first.strip()


def undefined_fastattn_symbols(nm: str, library: Path) -> list[str]:
    """Functions of namespace fastattn the library calls but no object defines (a definition
    left inside an x86 guard): undefined symbols of the linked library, demangled."""
    listed = subprocess.run([nm, "--undefined-only", "--demangle", str(library)],
                            capture_output=True, text=True, check=True).stdout
    return [line.split(None, 1)[-1] for line in listed.splitlines() if "fastattn::" in line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.cross_compile",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--target", default="aarch64-linux-gnu",
                        help="GNU target triple of the cross compiler (default: aarch64-linux-gnu)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    compiler, nm = f"{args.target}-g++", f"{args.target}-nm"
    if shutil.which(compiler) is None or shutil.which(nm) is None:
        print(f"error: {compiler} is not installed (Debian: g++-{args.target})", file=sys.stderr)
        return 2
    sources = sorted((REPO / "csrc").glob("*.cpp"))
    with tempfile.TemporaryDirectory() as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(partial(compile_one, compiler), sources, objects))
        failed = [(source, error) for source, error in results if error]
        for source, error in failed:
            print(f"{source.relative_to(REPO)}: {error}", file=sys.stderr)
        if failed:
            return 1
        library = Path(tmp) / "_C.so"
        linked = subprocess.run([compiler, "-shared", "-fopenmp", "-o", str(library),
                                 *map(str, objects)], capture_output=True, text=True)
        if linked.returncode != 0:
            print(f"link: {linked.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        missing = undefined_fastattn_symbols(nm, library)
        if missing:
            print(f"undefined on {args.target}: {', '.join(missing)}", file=sys.stderr)
            return 1
    print(f"{args.target}: {len(sources)} sources of fastattn._C compiled and linked, "
          "no fastattn function undefined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
