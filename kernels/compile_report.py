"""Compiles every shipped Triton kernel configuration for NVIDIA GPUs, no GPU needed, and reports
what the hardware would run: registers per thread, spilled bytes, shared memory, and whether the
matrix products became tensor-core instructions (mma.sync on sm_80+, wgmma on sm_90, tcgen05 on
sm_100).

    python -m fastattn.kernels.compile_report [--arch 80 86 89 90 100 120] [--json PATH]
                                              [--jobs N] [--subset | --family-subset]
                                              [--seed-pointers]

Protocol: each module in KERNEL_MODULES defines

    def compile_configs() -> list[dict]

listing every configuration its launchers can pick, one dict per compilation with the keys
    name        str, unique within the module: kernel, head dim / width, dtype, features
    fn          the @triton.jit function
    signature   {argument name: type string as triton.compiler.ASTSource takes it ("*fp16",
                "i32", "fp32", ...), with "constexpr" for compile-time arguments}, in the
                kernel's argument order; a type may end in ":16" (as in triton.tools.compile)
                for arguments the launcher always passes divisible by 16 (16-byte aligned
                pointers, strides), which Triton's launcher would specialise on too
    constexprs  {constexpr argument name: value}
    num_warps   int
    num_stages  int
    archs       optional: the compute capabilities that launch it (default: all)
and the report compiles each one for every requested architecture with triton.compile. Triton
caches compiled kernels (~/.triton/cache), so a second run only re-reads the binaries.

Registers, stack (spill) bytes and shared memory come from the cubin (cuobjdump
--dump-resource-usage, shipped with Triton); tensor-core use from the PTX (mma.sync, wgmma,
tcgen05.mma). The default architectures are one of each tile family of kernels.attention
(sm_80; sm_86, 89 and 120 with 99 KB of shared memory per block; sm_90 and 100 with 227 KB).

--subset compiles a representative part (SUBSET: every kernel at least once, attention's fp16
tiles at head dims 64 and 128 and an fp32 forward, the model's widths): what CI checks for sm_80
and sm_90, in about a fifth of the time. --family-subset compiles less (FAMILY_SUBSET: attention
in its heaviest variant at head dims 64 and 128 in fp16, and the widest fp32 dK/dV, the largest
shared memory): what CI checks for sm_86, 100 and 120. The full report stays the default.

--seed-pointers compiles the configurations with dropout as the ops launch them inside
fastattn.ops.seeds.from_device (for CUDA graphs): their seeds read through pointers ("*i64")
rather than passed by value, the rows named "... seed-pointer".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

KERNEL_MODULES = ("fastattn.kernels.attention", "fastattn.kernels.layer_norm",
                  "fastattn.kernels.cross_entropy", "fastattn.kernels.relu",
                  "fastattn.kernels.embedding")
DEFAULT_ARCHS = (80, 86, 89, 90, 100, 120)
# The representative subset (--subset, CI): per module, the configurations whose name matches;
# a kernel (@triton.jit function) none of whose configurations match adds its first one, so every
# kernel of every module compiles at least once whatever its configurations are named.
SUBSET = {
    "fastattn.kernels.attention": r"^\S+ d=(64|128) fp16\b|^_attn_fwd d=64 fp32\b",
    "fastattn.kernels.layer_norm": r"_N(512|1024|2048|4096)$|_wide_",
    "fastattn.kernels.cross_entropy": r"_V(1024|4096)$",
    "fastattn.kernels.relu": r" (fp16|bf16)$",
    "fastattn.kernels.embedding": r"_N(512|1024)$",
}
FAMILY_SUBSET = {
    "fastattn.kernels.attention": r"^\S+ d=(64|128) fp16 mask\+causal\+dropout"
                                  r"|^_attn_bwd_dkdv d=256 fp32 tf32 mask\+causal\+dropout",
}


# The kernels' dropout seed arguments (an "i64" in the configurations), and their dropout flags.
SEED_ARGS = ("seed", "philox_seed", "philox_offset")
DROPOUT_FLAGS = ("DROPOUT", "HAS_DROPOUT")


@dataclass
class CompiledConfig:
    module: str
    name: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # stack frame: where ptxas puts spilled registers
    shared_bytes: int
    mma: bool
    wgmma: bool
    tcgen05: bool = False


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the single kernel in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return registers, stack + local


def compile_config(module: str, config: dict, arch: int) -> CompiledConfig:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # "type:16" marks an argument divisible by 16, as in triton.tools.compile signatures.
    signature, attrs = {}, {}
    for index, (name, kind) in enumerate(config["signature"].items()):
        signature[name], _, hint = kind.partition(":")
        if hint == "16":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(config["fn"], signature, constexprs=config["constexprs"], attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": config["num_warps"],
                                     "num_stages": config["num_stages"]})
    registers, spill_bytes = _resource_usage(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    return CompiledConfig(module=module, name=config["name"], arch=arch,
                          num_warps=config["num_warps"], num_stages=config["num_stages"],
                          registers=registers, spill_bytes=spill_bytes,
                          shared_bytes=kernel.metadata.shared,
                          mma=re.search(r"\bmma\.sync", ptx) is not None,
                          wgmma=re.search(r"\bwgmma\.", ptx) is not None,
                          tcgen05=re.search(r"\btcgen05\.mma\b", ptx) is not None)


def seeds_through_pointers(config: dict) -> dict | None:
    """config with its dropout seeds read through pointers to int64 (fastattn.ops.seeds's device
    table), or None for a configuration without dropout."""
    if not any(config["constexprs"].get(flag) for flag in DROPOUT_FLAGS):
        return None
    signature = {name: "*i64" if name in SEED_ARGS else kind
                 for name, kind in config["signature"].items()}
    return dict(config, name=f"{config['name']} seed-pointer", signature=signature)


def _compile_one(module_name: str, index: int, arch: int,
                 seed_pointers: bool = False) -> CompiledConfig:
    config = importlib.import_module(module_name).compile_configs()[index]
    if seed_pointers:
        config = seeds_through_pointers(config)
    return compile_config(module_name, config, arch)


def subset_indices(module_name: str, configs: list[dict], family: bool = False) -> list[int]:
    """The indices of `configs` (module_name's compile_configs()) in the representative subset
    (family: in FAMILY_SUBSET, and no other kernel of the module)."""
    patterns = FAMILY_SUBSET if family else SUBSET
    pattern = re.compile(patterns.get(module_name, r"(?!)"))
    chosen = [i for i, c in enumerate(configs) if pattern.search(c["name"])]
    if family:
        return chosen
    covered = {id(configs[i]["fn"]) for i in chosen}
    for i, config in enumerate(configs):
        if id(config["fn"]) not in covered:  # a kernel without a matching configuration
            chosen.append(i)
            covered.add(id(config["fn"]))
    return sorted(chosen)


def collect(modules=KERNEL_MODULES, archs=DEFAULT_ARCHS, jobs: int = 1,
            subset: bool = False, seed_pointers: bool = False,
            family_subset: bool = False) -> list[CompiledConfig]:
    """Compiles every configuration of every module that defines compile_configs() (subset or
    family_subset: the representative ones, subset_indices; seed_pointers: only those with
    dropout, their seeds through pointers), on `jobs` worker processes (ptxas is
    single-threaded)."""
    work = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        if hasattr(module, "compile_configs"):  # an op without Triton kernels has none
            configs = module.compile_configs()
            indices = (subset_indices(module_name, configs, family_subset)
                       if subset or family_subset else range(len(configs)))
            if seed_pointers:
                indices = [i for i in indices if seeds_through_pointers(configs[i])]
            work += [(module_name, i, arch, seed_pointers) for i in indices for arch in archs
                     if arch in configs[i].get("archs", archs)]
    if jobs <= 1:
        return [_compile_one(*args) for args in work]
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch state
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return list(pool.map(_compile_one, *zip(*work, strict=True)))


def format_table(results: list[CompiledConfig]) -> str:
    header = ("kernel configuration", "sm", "warps", "stages", "regs", "spill B", "smem B",
              "mma", "wgmma", "tcgen05")
    rows = [(r.name, str(r.arch), str(r.num_warps), str(r.num_stages), str(r.registers),
             str(r.spill_bytes), str(r.shared_bytes),
             *("yes" if used else "no" for used in (r.mma, r.wgmma, r.tcgen05)))
            for r in results]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS),
                        help="compute capabilities to compile for (default: "
                             f"{' '.join(map(str, DEFAULT_ARCHS))})")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--module", nargs="+", default=list(KERNEL_MODULES),
                        help="kernel modules to report (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="parallel compilations (default: one per CPU)")
    parser.add_argument("--subset", action="store_true",
                        help="only the representative configurations (SUBSET), as CI does")
    parser.add_argument("--family-subset", action="store_true",
                        help="only FAMILY_SUBSET's configurations, as CI compiles for "
                             "sm_86, 100 and 120")
    parser.add_argument("--seed-pointers", action="store_true",
                        help="only the configurations with dropout, their seeds read through "
                             "pointers (fastattn.ops.seeds.from_device)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_report: unset TRITON_INTERPRET; the interpreter does not compile")
    results = collect(args.module, args.arch, args.jobs, subset=args.subset,
                      seed_pointers=args.seed_pointers, family_subset=args.family_subset)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
