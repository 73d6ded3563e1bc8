"""kernels.attention's tile policy (launch_tile): one function for every GPU family, checked in
pure Python against each family's shared memory per block, the shape its tensor-core products
need, and the compile report the repository ships (benchmarks/compile_report.json)."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from fastattn.kernels import attention
from fastattn.kernels.attention import (
    FAMILIES,
    HEAVIEST,
    OVERRIDES,
    VARIANTS,
    family,
    launch_tile,
    shared_bytes_estimate,
    tile_variant,
)

KIB = 1024
REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "compile_report.json"
HEAD_DIMS = (16, 24, 32, 40, 64, 80, 96, 128, 160, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ARCH_OF = {"sm80": 80, "sm86": 86, "sm120": 120, "sm90": 90, "sm100": 100}  # one of each family


def launches():
    """Every (kernel, head dim, dtype, variant keywords, precision) the launchers can ask for."""
    for kernel, d, dtype, flags, precision in itertools.product(
            attention.KERNELS, HEAD_DIMS, DTYPES, VARIANTS.values(), ("ieee", "tf32")):
        yield kernel, d, dtype, tile_variant(*flags), precision


def element_size(dtype):
    return 4 if dtype == torch.float32 else 2


def test_families_and_their_shared_memory_per_block():
    assert family(80).shared_bytes == 163 * KIB
    assert {family(a).shared_bytes for a in (86, 89, 120)} == {99 * KIB}
    assert {family(a).shared_bytes for a in (90, 100)} == {227 * KIB}
    assert {family(a).mma_rows for a in (90, 100)} == {64}
    assert {family(a).mma_rows for a in (80, 86, 89, 120)} == {16}
    assert {f.name for f in FAMILIES.values()} == set(ARCH_OF)
    assert all(o.families and set(o.families) <= set(ARCH_OF) for o in OVERRIDES)
    # an architecture not listed takes the closest one below it; Volta and Turing sm_86's
    assert family(88) == family(87) == family(80)
    assert family(110) == family(103) == family(100) and family(122) == family(120)
    assert family(75) == family(70) == family(86)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_tile_fits_its_familys_shared_memory(arch):
    """The tile of every launch, at every head dim (padded ones too), dtype, variant and
    precision, takes no more shared memory than the family has per block, by
    shared_bytes_estimate (an upper bound: test_the_estimate_bounds_every_compiled_row). Before
    the policy, sm_86/89/120 got sm_80's dK/dV tile at d = 256 in fp32, which took 114,688 B
    (compile report) of their 101,376."""
    limit = family(arch).shared_bytes - family(arch).staging_bytes
    too_big = []
    for kernel, d, dtype, variant, precision in launches():
        tile = launch_tile(kernel, d, dtype, arch, **variant, precision=precision)
        needed = shared_bytes_estimate(kernel, tile, attention._block_d(d), element_size(dtype))
        if needed > limit:
            too_big.append((kernel, d, dtype, variant, precision, tile, needed))
    assert too_big == []


def test_tiles_are_powers_of_two_that_tl_dot_takes():
    """Blocks of at least 16 rows (tl.dot's minimum), but dK/dV's queries (the N of its products,
    8 on Hopper at d = 128 in fp32), warps 4 or 8, one to three stages."""
    for arch in FAMILIES:
        for kernel, d, dtype, variant, precision in launches():
            block_m, block_n, warps, stages = launch_tile(kernel, d, dtype, arch, **variant,
                                                          precision=precision)
            assert block_m & (block_m - 1) == 0 and block_n & (block_n - 1) == 0
            assert block_n >= 16 and block_m >= (8 if kernel == "_attn_bwd_dkdv" else 16)
            assert warps in (4, 8) and 1 <= stages <= 3


def test_warp_group_families_give_every_product_64_rows():
    """On sm_90 and sm_100 every tensor-core product up to head dim 128 (16 bits, or fp32 with
    tf32) has an M of 64 rows or a multiple per warp group, 8 warps: wgmma's and tcgen05's shape
    (below it Triton falls back to mma.sync). Blackwell took Ampere's tiles before the policy."""
    for arch in (90, 100):
        for kernel, d, dtype, variant, precision in launches():
            if d > 128 or (dtype == torch.float32 and precision == "ieee"):
                continue
            block_m, block_n, warps, _ = launch_tile(kernel, d, dtype, arch, **variant,
                                                     precision=precision)
            rows = block_n if kernel == "_attn_bwd_dkdv" else block_m
            assert rows % 64 == 0 and warps == 8, (arch, kernel, d, dtype, variant)


def own_override(kernel, d, dtype, arch, variant, precision, like):
    """Whether the override deciding this launch on arch (if any) is not the one on `like`: a
    family's override, with its reason, sets their tiles apart."""
    found = [attention._override(kernel, attention._block_d(d), element_size(dtype), family(a),
                                 exact=element_size(dtype) == 4 and precision == "ieee",
                                 **variant) for a in (arch, like)]
    return found[0] != found[1]


def test_other_families_take_sm80s_and_sm90s_tiles_unless_they_do_not_fit_or_spill():
    """sm_86, 89 and 120 compile the same mma.sync products as sm_80 and take its tiles, its
    per-variant overrides included (they took only the per-head-dim tables before), except where
    sm_80's tile does not fit their 99 KB or an override of their family says why; sm_100 takes
    sm_90's (it took sm_80's) but for its own overrides."""
    changed = set()
    for kernel, d, dtype, variant, precision in launches():
        ampere = launch_tile(kernel, d, dtype, 80, **variant, precision=precision)
        for arch in (86, 89, 120):
            tile = launch_tile(kernel, d, dtype, arch, **variant, precision=precision)
            if tile != ampere and not own_override(kernel, d, dtype, arch, variant, precision,
                                                   80):
                needed = shared_bytes_estimate(kernel, ampere, attention._block_d(d),
                                               element_size(dtype))
                assert needed > family(arch).shared_bytes, (kernel, d, dtype, variant, arch)
                changed.add((kernel, attention._block_d(d), element_size(dtype)))
        if not own_override(kernel, d, dtype, 100, variant, precision, 90):
            assert launch_tile(kernel, d, dtype, 100, **variant, precision=precision) == \
                launch_tile(kernel, d, dtype, 90, **variant, precision=precision)
    assert ("_attn_bwd_dkdv", 256, 4) in changed
    mask = dict(mask="query", causal=False, dropout=False)
    assert launch_tile("_attn_bwd_dq", 64, torch.float16, 86, **mask) == (64, 32, 8, 3)


def test_every_override_changes_its_launch_and_says_why(monkeypatch):
    """An override its launch would get anyway (from steps 1 and 2, or a later override) would
    be dead weight; each names its reason."""
    for o in OVERRIDES:
        assert o.why
        block_d, size = o.entry
        arch = ARCH_OF[o.families[0]]
        variant = tile_variant(*VARIANTS[o.variant or HEAVIEST])
        dtype = torch.float32 if size == 4 else torch.float16
        precision = "ieee" if o.exact else "tf32"
        assert launch_tile(o.kernel, block_d, dtype, arch, **variant,
                           precision=precision) == o.tile, o
        with monkeypatch.context() as patch:
            patch.setattr(attention, "OVERRIDES", tuple(x for x in OVERRIDES if x != o))
            assert launch_tile(o.kernel, block_d, dtype, arch, **variant,
                               precision=precision) != o.tile, o


def test_the_estimate_bounds_every_compiled_row():
    """shared_bytes_estimate (with the family's staging_bytes) is at least the shared memory of
    every attention row of the shipped compile report, on every family it covers, so a tile the
    policy fits under a family's limit compiles under it; and no row, of any module, takes more
    than its family has. The report must be the current configurations' (python -m
    fastattn.kernels.compile_report --json benchmarks/compile_report.json)."""
    rows = json.loads(REPORT.read_text())
    configs = {c["name"]: c for c in attention.compile_configs()}
    attention_rows = [r for r in rows if r["module"] == attention.__name__]
    assert {(r["name"], r["arch"]) for r in attention_rows} == {
        (name, arch) for name, c in configs.items()
        for arch in c.get("archs", attention.COMPILE_ARCHS)}
    for r in attention_rows:
        c = configs[r["name"]]
        tile = (c["constexprs"]["BLOCK_M"], c["constexprs"]["BLOCK_N"], c["num_warps"],
                c["num_stages"])
        size = 2 if "fp16" in r["name"].split() else 4
        estimate = shared_bytes_estimate(c["fn"].__name__, tile, c["constexprs"]["BLOCK_D"],
                                         size) + family(r["arch"]).staging_bytes
        assert r["shared_bytes"] <= estimate, (r["name"], r["arch"], r["shared_bytes"], estimate)
    assert {r["arch"] for r in rows} >= {80, 86, 89, 90, 120}
    assert [(r["name"], r["arch"]) for r in rows
            if r["shared_bytes"] > family(r["arch"]).shared_bytes] == []
