"""fastattn.kernels.compile_report: the representative subset of the shipped kernel configurations
(--subset: every kernel at least once, attention's fp16 tiles at head dims 64 and 128) compiles for
sm_80 and sm_90 (Triton's bundled ptxas, no GPU needed), and attention's configurations for head
dims up to 128 spill no registers; a smaller one (--family-subset) for the other tile families,
sm_86, 100 and 120, within their shared memory. FASTATTN_COMPILE_REPORT=full checks every
configuration instead (minutes on 2 cores the first time; Triton's cache, ~/.triton/cache,
makes later runs fast), as `python -m fastattn.kernels.compile_report` reports them. The sweep
of every attention variant with the launchers' tiles guards tuning: CI compiles the model's
variants, `./run test -m sweep` all of them (marker `sweep`)."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastattn.kernels import attention, embedding, layer_norm
from fastattn.kernels.compile_report import (
    KERNEL_MODULES,
    CompiledConfig,
    _cuobjdump,
    format_table,
    seeds_through_pointers,
    subset_indices,
)

ARCHS = (80, 90)
# The other tile families' architectures CI compiles: sm_89's attention rows equal sm_86's in the
# full report (python -m fastattn.kernels.compile_report), so CI leaves it to that sweep.
OTHER_FAMILIES = (86, 100, 120)
FULL = os.environ.get("FASTATTN_COMPILE_REPORT") == "full"
# Triton 3.6.0, the GPU machine's image's, beside the venv's own (./run test installs it there).
TRITON_36 = Path(sys.prefix) / "triton-3.6.0"


def checked_configs(module) -> list[dict]:
    """The configurations of a kernel module the report here compiles."""
    configs = module.compile_configs()
    return configs if FULL else [configs[i] for i in subset_indices(module.__name__, configs)]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[dict]:
    if not os.path.exists(_cuobjdump()):
        pytest.skip("Triton's bundled NVIDIA tools (ptxas, cuobjdump) are not installed")
    path = tmp_path_factory.mktemp("compile_report") / "report.json"
    # The interpreter does not compile: run the report in a process without it.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "fastattn.kernels.compile_report", "--arch",
                    *map(str, ARCHS), "--json", str(path), *([] if FULL else ["--subset"])],
                   env=env, check=True, timeout=3600, capture_output=True)
    return json.loads(path.read_text())


def kernel_modules():
    return [module for name in KERNEL_MODULES
            if hasattr(module := importlib.import_module(name), "compile_configs")]


@pytest.mark.slow
def test_every_checked_config_compiles_for_sm80_and_sm90(report):
    checked = {(module.__name__, config["name"], arch) for module in kernel_modules()
               for config in checked_configs(module) for arch in ARCHS
               if arch in config.get("archs", ARCHS)}
    assert {(r["module"], r["name"], r["arch"]) for r in report} == checked
    assert all(r["registers"] > 0 for r in report)


def test_subset_compiles_every_kernel_and_attention_at_64_and_128():
    for module in kernel_modules():
        configs = module.compile_configs()
        subset = [configs[i] for i in subset_indices(module.__name__, configs)]
        assert {id(c["fn"]) for c in subset} == {id(c["fn"]) for c in configs}, module.__name__
        assert len(subset) < len(configs), module.__name__
    fp16 = [c for c in checked_configs(attention) if "fp16" in c["name"].split()]
    assert {c["constexprs"]["HEAD_DIM"] for c in fp16} >= {64, 128}


def attention_rows(report, max_head_dim=128):
    head_dim = {c["name"]: c["constexprs"]["HEAD_DIM"] for c in checked_configs(attention)}
    return [r for r in report
            if r["module"] == attention.__name__ and head_dim[r["name"]] <= max_head_dim]


@pytest.mark.slow
def test_attention_up_to_head_dim_128_spills_nothing_and_stays_under_the_cap(report):
    """No spill, and no configuration at the 255-register cap (one more live value spills)."""
    spilled = [(r["name"], r["arch"], r["spill_bytes"]) for r in attention_rows(report)
               if r["spill_bytes"] > 0]
    assert not spilled, f"configurations that spill: {spilled}"
    capped = [(r["name"], r["arch"]) for r in attention_rows(report) if r["registers"] >= 255]
    assert not capped, f"configurations at the register cap: {capped}"


@pytest.mark.slow
def test_layer_norm_and_cross_entropy_spill_nothing(report):
    """Their kernels hold a row in registers: a spill would go to local memory on every row."""
    spilled = [(r["name"], r["arch"], r["registers"], r["spill_bytes"]) for r in report
               if r["module"] != attention.__name__ and r["spill_bytes"] > 0]
    assert not spilled, f"configurations that spill: {spilled}"


@pytest.mark.slow
def test_hopper_attention_matmuls_up_to_head_dim_128_run_on_wgmma(report):
    """Every forward, dK/dV and dQ kernel Hopper launches in 16 bits and in fp32 with tf32
    products at head dims up to 128, every product of it (no mma.sync left). fp32's exact
    (IEEE) products run on FMA units."""
    rows = [r for r in attention_rows(report) if r["arch"] == 90
            and {"fp16", "tf32"} & set(r["name"].split()) and "delta" not in r["name"]]
    assert {r["name"].split()[0] for r in rows} == {"_attn_fwd", "_attn_bwd_dkdv",
                                                    "_attn_bwd_dq"}
    assert [r["name"] for r in rows if not r["wgmma"] or r["mma"]] == []


@pytest.mark.slow
def test_attention_matmuls_use_tensor_cores_in_16_bit(report):
    """fp16 tiles become mma.sync on sm_80 and mma or wgmma on sm_90 (fp32 runs the exact
    IEEE product on FMA units unless torch allows tf32)."""
    matmul_kernels = [r for r in report if r["module"] == attention.__name__
                      and "fp16" in r["name"].split() and "delta" not in r["name"]]
    assert matmul_kernels
    for r in matmul_kernels:
        assert r["mma"] or r["wgmma"], (r["name"], r["arch"])


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_dkdv_at_head_dims_64_and_128_runs_on_wgmma(report, head_dim):
    """The dK/dV pass Hopper launches at the model's head dim (base and big: 64) and at 128, in
    16 bits, is wgmma, not mma.sync (the Ampere tiles' 32 keys cannot form wgmma's 64-row
    tiles), with no spill and under the register cap (docs/benchmark-notes.md)."""
    dkdv = [r for r in report if r["name"].startswith(f"_attn_bwd_dkdv d={head_dim} fp16")
            and r["arch"] == 90]
    assert [r["name"] for r in dkdv] == [
        f"_attn_bwd_dkdv d={head_dim} fp16 mask+causal+dropout sm90-tile"]
    assert dkdv[0]["wgmma"] and dkdv[0]["spill_bytes"] == 0 and dkdv[0]["registers"] < 255


def test_exact_float32_products_take_their_own_tiles_first():
    """launch_tile: float32 with exact (IEEE) products, torch's default, takes the exact
    overrides before the others and the policy's steps; with tf32 products, and in 16 bits, they
    do not apply. Hopper's forward at d = 128 with a mask per query: the tf32 tile spilled
    208-280 B in exact products (docs/benchmark-notes.md)."""
    import torch

    query_mask = dict(mask="query", causal=True, dropout=True)
    exact = attention.launch_tile("_attn_fwd", 128, torch.float32, 90, **query_mask,
                                  precision="ieee")
    tf32 = attention.launch_tile("_attn_fwd", 128, torch.float32, 90, **query_mask,
                                 precision="tf32")
    assert exact == (32, 16, 8, 2) and tf32 == (64, 16, 8, 2)  # wgmma's 64 queries
    # the default follows torch's setting, as the kernels' DOT_PRECISION does
    assert attention.launch_tile("_attn_fwd", 128, torch.float32, 90, **query_mask) == exact
    assert attention.launch_tile("_attn_fwd", 128, torch.float16, 90, **query_mask,
                                 precision="ieee") == (64, 32, 8, 3)
    # a variant tile for Ampere's key padding: exact products 8 warps, tf32 4 (OVERRIDES)
    key = dict(mask="key", causal=False, dropout=False)
    assert attention.launch_tile("_attn_fwd", 64, torch.float32, 80, **key,
                                 precision="ieee") == (64, 32, 8, 2)
    assert attention.launch_tile("_attn_fwd", 64, torch.float32, 80, **key,
                                 precision="tf32") == (64, 32, 4, 2)


@pytest.mark.slow
def test_other_families_compile_within_their_shared_memory(tmp_path):
    """--family-subset for sm_86, 100 and 120 (attention in its heaviest variant at head
    dims 64 and 128 in fp16, and the fp32 dK/dV at 256 with tf32 products, sm_80's 114,688 B of
    which sm_86/89/120 do not have): every configuration those architectures launch compiles,
    within the family's shared memory per block (attention.family), no spill nor the register
    cap at d <= 128, and there the products on tensor cores: mma.sync on sm_86/120, tcgen05 on
    sm_100 (FAMILY_SUBSET keeps this to a few compilations per family)."""
    if not os.path.exists(_cuobjdump()):
        pytest.skip("Triton's bundled NVIDIA tools (ptxas, cuobjdump) are not installed")
    path = tmp_path / "report.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "fastattn.kernels.compile_report", "--arch",
                    *map(str, OTHER_FAMILIES), "--family-subset", "--jobs", "2", "--json",
                    str(path)], env=env, check=True, timeout=1800, capture_output=True)
    rows = json.loads(path.read_text())
    configs = attention.compile_configs()
    expected = {(configs[i]["name"], arch)
                for i in subset_indices(attention.__name__, configs, family=True)
                for arch in OTHER_FAMILIES
                if arch in configs[i].get("archs", OTHER_FAMILIES)}
    assert {(r["name"], r["arch"]) for r in rows} == expected
    assert {r["arch"] for r in rows} == set(OTHER_FAMILIES)
    assert any("d=256" in r["name"] for r in rows)
    assert [(r["name"], r["arch"], r["shared_bytes"]) for r in rows
            if r["shared_bytes"] > attention.family(r["arch"]).shared_bytes] == []
    assert [(r["name"], r["arch"], r["registers"], r["spill_bytes"]) for r in rows
            if "d=256" not in r["name"] and (r["spill_bytes"] or r["registers"] >= 255)] == []
    assert [(r["name"], r["arch"]) for r in rows if "d=256" not in r["name"]
            and not (r["tcgen05"] if r["arch"] == 100 else r["mma"] and not r["wgmma"])] == []


# The variants' compile sweep (benchmarks.attention_tiles --shipped): CI compiles the model's four
# variants at its head dim (64, base and big) in fp16 for sm_80 and sm_90 (24 compilations); the
# whole sweep, every variant at head dims 16 to 128 in fp16 and fp32 (960 compilations: 4 to 25
# minutes on 2 cores with a cold Triton cache), guards tuning only and is marked `sweep`
# (./run test -m sweep).
VARIANT_SWEEPS = [
    pytest.param(attention.MODEL_VARIANTS, ("64",), ("fp16",), id="the model's variants at d=64"),
    pytest.param(tuple(attention.VARIANTS), ("16", "32", "64", "128"), ("fp16", "fp32"),
                 id="every variant at d=16-128", marks=pytest.mark.sweep),
]


@pytest.mark.slow
@pytest.mark.parametrize(("variants", "head_dims", "dtypes"), VARIANT_SWEEPS)
def test_every_variant_compiles_clean_with_the_launchers_tiles(tmp_path, variants, head_dims,
                                                               dtypes):
    """compile_configs() compiles each entry in its heaviest variant, and ptxas does not allocate
    monotonically in the features (docs/benchmark-notes.md), so each of the 20 variants of
    kernels.attention.VARIANTS (no mask, key padding or a mask per query, bool or float, each
    with and without causal and dropout: the model's four and the drop-in's) is compiled too,
    with the tile the launchers pick for it (benchmarks.attention_tiles --shipped), at head dims
    16 to 128 in fp16 (bf16 compiled to the same registers in every case measured) and fp32
    (products in tf32): no spill, under the register cap, and on sm_90 every product on wgmma,
    none on mma.sync (docs/benchmark-notes.md). CI: the model's variants at d=64 in fp16."""
    if not os.path.exists(_cuobjdump()):
        pytest.skip("Triton's bundled NVIDIA tools (ptxas, cuobjdump) are not installed")
    path = tmp_path / "tiles.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "benchmarks.attention_tiles", "--shipped",
                    "--variant", *variants, "--head-dim", *head_dims, "--dtype", *dtypes,
                    "--arch", *map(str, ARCHS), "--jobs", "2", "--json", str(path)],
                   env=env, check=True, timeout=1800, capture_output=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = json.loads(path.read_text())
    assert len(rows) == 3 * len(variants) * len(head_dims) * len(dtypes) * len(ARCHS)
    bad = [(r["name"], r["arch"], r["registers"], r["spill_bytes"]) for r in rows
           if r["spill_bytes"] or r["registers"] >= 255
           or (r["arch"] == 90 and (not r["wgmma"] or r["mma"]))]
    assert not bad, f"spilling, at the cap, or not all wgmma on sm_90: {bad}"


@pytest.mark.slow
def test_dropout_kernels_compile_with_seeds_through_pointers_for_sm90(tmp_path):
    """Inside fastattn.ops.seeds.from_device (CUDA graphs) the dropout kernels read their seeds
    through pointers ("*i64"), a specialisation of their own: the subset's configurations of
    every kernel taking a seed (attention's three, LayerNorm's three, embedding's two) compile so
    for sm_90 without spilling, attention's on wgmma; and so do the attention kernels the model
    launches with dropout (head dim 64, bf16, key padding or causal: benchmarks.attention_tiles)."""
    if not os.path.exists(_cuobjdump()):
        pytest.skip("Triton's bundled NVIDIA tools (ptxas, cuobjdump) are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    modules = [module.__name__ for module in (attention, layer_norm, embedding)]
    report_path, tiles_path = tmp_path / "report.json", tmp_path / "tiles.json"
    subprocess.run([sys.executable, "-m", "fastattn.kernels.compile_report", "--arch", "90",
                    "--subset", "--seed-pointers", "--module", *modules, "--jobs", "2",
                    "--json", str(report_path)], env=env, check=True, timeout=1800,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "benchmarks.attention_tiles", "--shipped",
                    "--head-dim", "64", "--dtype", "bf16", "--variant", *attention.MODEL_VARIANTS,
                    "--arch", "90", "--seed-pointers", "--jobs", "2", "--json", str(tiles_path)],
                   env=env, check=True, timeout=1800, capture_output=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    expected, kernels = set(), set()
    for module in (attention, layer_norm, embedding):
        for config in checked_configs(module):
            if (pointers := seeds_through_pointers(config)) and 90 in config.get("archs", (90,)):
                expected.add(pointers["name"])
                kernels.add(config["fn"].__name__)
    assert kernels == {"_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv", "_layer_norm_fwd_kernel",
                       "_layer_norm_bwd_kernel", "_layer_norm_bwd_wide_kernel",
                       "_embedding_fwd_kernel", "_embedding_bwd_kernel"}
    report = json.loads(report_path.read_text())
    assert {r["name"] for r in report} == expected
    tiles = json.loads(tiles_path.read_text())
    assert len(tiles) == 3 * 2  # three kernels, two variants with dropout
    rows = report + tiles
    assert all(r["registers"] > 0 and "seed-pointer" in r["name"] for r in rows)
    assert [(r["name"], r["spill_bytes"]) for r in rows if r["spill_bytes"]] == []
    matmuls = tiles + [r for r in report if r["module"] == attention.__name__
                       and {"fp16", "tf32"} & set(r["name"].split())]
    assert [r["name"] for r in matmuls if not r["wgmma"] or r["mma"] or r["registers"] >= 255] \
        == []


@pytest.mark.slow
@pytest.mark.parametrize("seed_pointers", [False, True], ids=["seeds by value", "by pointer"])
def test_the_subset_compiles_for_sm90_under_triton_3_6(tmp_path, seed_pointers):
    """The oldest Triton fastattn supports (backend.TRITON_RANGE), first on PYTHONPATH: every
    kernel of the subset compiles for sm_90, the dropout ones with their seeds by value and by
    pointer, without spilling, attention's products on wgmma (3.6 rejected every dropout kernel
    when scalar() called tl.to_tensor, which only later Tritons export)."""
    assert (TRITON_36 / "triton").is_dir(), (
        f"Triton 3.6.0 is not installed at {TRITON_36}: ./run test installs it, or `python -m "
        f"pip install --no-deps --target {TRITON_36} triton==3.6.0`")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_36), *filter(None, [env.get("PYTHONPATH")])])
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                             env=env, check=True, capture_output=True, text=True).stdout
    assert version.strip() == "3.6.0"
    path = tmp_path / "report.json"
    flags = ["--seed-pointers"] if seed_pointers else []
    done = subprocess.run([sys.executable, "-m", "fastattn.kernels.compile_report", "--arch", "90",
                           "--subset", *flags, "--jobs", "2", "--json", str(path)], env=env,
                          timeout=1800, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = set()
    for module in kernel_modules():
        configs = module.compile_configs()
        for i in subset_indices(module.__name__, configs):
            config = seeds_through_pointers(configs[i]) if seed_pointers else configs[i]
            if config and 90 in configs[i].get("archs", (90,)):
                expected.add((module.__name__, config["name"]))
    rows = json.loads(path.read_text())
    assert {(r["module"], r["name"]) for r in rows} == expected
    assert all(r["arch"] == 90 and r["registers"] > 0 for r in rows)
    assert [(r["name"], r["spill_bytes"]) for r in rows if r["spill_bytes"]] == []
    matmuls = [r for r in rows if r["module"] == attention.__name__
               and {"fp16", "tf32"} & set(r["name"].split()) and "delta" not in r["name"]]
    assert matmuls and [r["name"] for r in matmuls if not r["wgmma"] or r["mma"]] == []


def test_table_lists_every_column():
    row = CompiledConfig(module="m", name="_k d=64 fp16", arch=80, num_warps=4, num_stages=3,
                         registers=128, spill_bytes=0, shared_bytes=32768, mma=True,
                         wgmma=False)
    header, rule, line = format_table([row]).splitlines()
    assert header.split() == ["kernel", "configuration", "sm", "warps", "stages", "regs",
                              "spill", "B", "smem", "B", "mma", "wgmma", "tcgen05"]
    assert set(rule) <= {"-", " "}
    assert line.split() == ["_k", "d=64", "fp16", "80", "4", "3", "128", "0", "32768", "yes",
                            "no", "no"]
