"""Shared test helpers. Test files import the helpers with `from conftest import ...`."""

from __future__ import annotations

import signal

import pytest
import torch

from fastattn._native import cpu_isa, set_cpu_isa, supported_cpu_isas
from fastattn.backend import get_backend

# A shell starts a background job with Ctrl-C ignored, and an ignored signal stays ignored in every
# process started from it: the tests that send SIGINT to a command need it back to the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Kernels run through Triton's CPU interpreter: slow, and without bf16 or fp64.
INTERPRETED = get_backend() == "triton"


# The tests that reach a Triton kernel on CPU tensors under FASTATTN_BACKEND=triton (marker
# `triton`): the interpreter pass of ./run test runs only these. Every test of the op modules (their
# few that launch nothing check the Triton path's argument checks and routing), and in the other
# modules the tests that launch one. Evidence: .ci/triton_probe.py, a pytest plugin recording the
# launches per test, over the whole suite under FASTATTN_BACKEND=triton TRITON_INTERPRET=1 (the
# tests launching in subprocesses of their own run FASTATTN_BACKEND=torch there). A new test that
# runs the model or the ops on CPU in another module belongs in TRITON_TESTS.
TRITON_MODULES = ("test_attention.py", "test_layer_norm.py", "test_cross_entropy.py",
                  "test_modules.py")
TRITON_TESTS = {
    "test_autocast.py": ["test_layer_norm_copies_give_autocasts_loss_and_gradients_bit_for_bit"],
    "test_checkpoint.py": ["test_load_model"],
    "test_decode_attention.py": ["test_decoder_step_bad_input_errors"],
    "test_distributed.py": ["test_two_ranks_equal_one_process_on_the_whole_batch"],
    "test_ensemble.py": [
        "test_beam_search_scores_are_the_ensembles_log_probability_of_the_hypothesis",
        "test_command_line_builds_an_ensemble_that_translate_reads",
        "test_decode_step_is_the_log_of_the_mean_probability_over_members",
        "test_ensemble_checkpoint_loads_as_its_members",
        "test_ensemble_of_one_is_the_model_and_of_copies_is_the_same_search",
        "test_translator_with_an_ensemble_of_copies_translates_like_the_model",
    ],
    "test_model.py": [
        "test_attention_weights_are_the_ones_the_model_uses",
        "test_cached_decoding_equals_teacher_forcing",
        "test_cached_decoding_follows_beam_search_reorders",
        "test_decode_step_does_not_rerun_the_prefix",
        "test_decoder_is_causal",
        "test_decoding_errors_are_clear",
        "test_decoding_follows_a_fused_optimiser",
        "test_decoding_follows_weights_updated_in_place",
        "test_decoding_one_row_per_sentence_then_beams",
        "test_dropout_only_in_training",
        "test_fused_loss_equals_label_smoothed_cross_entropy_of_logits",
        "test_loss_returns_the_unsmoothed_nll_too",
        "test_native_beam_search_does_not_depend_on_earlier_searches",
        "test_native_beam_search_equals_search_over_decode_step",
        "test_padding_changes_nothing",
        "test_rdrop_loss_is_two_dropout_passes_with_their_symmetric_kl",
        "test_rdrop_loss_without_dropout_is_the_loss",
        "test_tied_embedding_scaled_by_sqrt_d_model",
    ],
    "test_train.py": [
        "test_accumulated_micro_batches_equal_one_batch",
        "test_clipping_bounds_the_update",
        "test_nan_guard_skips_the_update",
        "test_output_vocab_target_numbers_the_target_pieces_first_and_a_resumed_run_keeps_it",
        "test_rdrop_update_reports_its_loss_and_moves_the_model",
        "test_update_changes_the_model_and_the_loss_per_token_is_right",
    ],
    "test_translate.py": [
        "test_a_truecased_model_truecases_sources_and_detruecases_translations",
        "test_attention_weights",
        "test_batching_changes_no_translation",
        "test_command_line",
        "test_input_order_survives_windows_and_length_sorting",
        "test_plot_attention",
        "test_stream_reads_only_a_window_ahead",
        "test_translator_matches_a_direct_beam_search",
    ],
    "test_translate_faults.py": [
        "test_a_model_with_learned_positions_translates_a_long_line_within_its_positions",
        "test_empty_lines_give_empty_lines_in_place",
        "test_stream_translates_what_was_read_before_its_input_fails",
        "test_the_cap_is_an_argument_and_truncation_keeps_the_first_pieces",
        "test_the_lines_before_a_long_one_are_given_before_it_is_decoded",
    ],
}


# The cases the interpreter pass leaves to a twin launching the same Triton kernels, as (test, or
# "*" for any, parameter, value): the native decoder's (it launches none; the Python decoder's
# case runs the same teacher-forced forwards), R-Drop's summed loss (summed by torch after the
# kernels of the mean) and pre-norm's autocast cases (none of the LayerNorm copies the test is
# about; post-norm's cases launch the same kernels and the copies), and R-Drop's (the same
# kernels and copies on the batch twice over).
TRITON_TWINS = [
    ("*", "decoder_path", "native"),
    ("test_rdrop_loss_is_two_dropout_passes_with_their_symmetric_kl", "reduction", "sum"),
    ("test_layer_norm_copies_give_autocasts_loss_and_gradients_bit_for_bit", "pre_norm", True),
    ("test_layer_norm_copies_give_autocasts_loss_and_gradients_bit_for_bit", "rdrop", True),
]


def left_to_a_twin(item, test: str) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(name in ("*", test) and key in params and params[key] == value
               for name, key, value in TRITON_TWINS)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    modules = {}
    for item in items:
        name = item.path.name
        modules.setdefault(name, getattr(item, "module", None))
        test = getattr(item, "originalname", item.name)
        if (name in TRITON_MODULES or test in TRITON_TESTS.get(name, ())) \
                and not left_to_a_twin(item, test):
            item.add_marker(pytest.mark.triton)
    # A renamed or removed test would leave the interpreter pass silently: name it.
    stale = [f"tests/{name}::{test}" for name, module in modules.items()
             for test in TRITON_TESTS.get(name, ()) if not hasattr(module, test)]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py TRITON_TESTS names missing tests: {stale}")


# pytest-xdist (./run test: -n 2 --dist loadfile) hands whole files to its workers in this order
# (pytest_configure turns off its own, most tests first): the files that take longest first, so
# that neither worker ends a pass alone on a long file while the other idles (xdist's order
# started test_compile_report's cold compilations and the fault and gpu_check subprocess tests
# among the last). Per pass, slowest first, from --durations on a 2-core Zen 4; the other files
# follow, most tests first.
SLOWEST_FIRST = {
    "torch": ("test_train.py", "test_compile_report.py", "test_gpu_check.py",
              "test_train_faults.py", "test_cross_entropy.py", "test_attention.py",
              "test_search.py", "test_pretrained.py", "test_ensemble.py",
              "test_translate_faults.py", "test_decode_attention.py", "test_modules.py"),
    "triton": ("test_attention.py", "test_model.py", "test_modules.py", "test_layer_norm.py",
               "test_autocast.py", "test_embedding.py", "test_cross_entropy.py", "test_relu.py",
               "test_train.py", "test_ensemble.py", "test_gpu_cases_cpu.py"),
}


class _SlowestFilesFirst:
    @pytest.hookimpl(trylast=True)  # after -m and -k deselect: order what runs
    def pytest_collection_modifyitems(self, config, items):
        first = SLOWEST_FIRST["triton" if INTERPRETED else "torch"]
        rank = {name: i for i, name in enumerate(first)}
        count = {}
        for item in items:
            count[item.path.name] = count.get(item.path.name, 0) + 1
        items.sort(key=lambda item: (rank.get(item.path.name, len(rank)),
                                     -count[item.path.name], item.path.name))


def pytest_configure(config):
    config.pluginmanager.register(_SlowestFilesFirst(), "fastattn-slowest-files-first")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6: keep this order
        config.option.loadscopereorder = False


# fastattn._C's CPU kernels at every instruction-set level this CPU runs (FASTATTN_CPU_ISA), so that
# an AVX-512 machine tests the AVX2 and scalar builds too; the interpreter pass, whose subject is
# the Triton kernels, keeps the level in use.
CPU_ISAS = (cpu_isa(),) if INTERPRETED else supported_cpu_isas()


@pytest.fixture(params=CPU_ISAS)
def at_every_cpu_isa(request) -> str:
    """Runs the test with fastattn._C's CPU kernels held to each level; the test gets it."""
    before = cpu_isa()
    level = set_cpu_isa(request.param)
    yield level
    set_cpu_isa(before)


@pytest.fixture
def seeded() -> int:
    """Seeds torch's default generators; the test gets the seed."""
    torch.manual_seed(1234)
    return 1234


def assert_graded_close(actual: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                        *, factor: float = 2.0, atol: float = 0.0, name: str = "") -> None:
    """actual's largest error against the (fp64) reference is at most `factor` times PyTorch's
    own error in the same precision (baseline, e.g. the reference run in fp16) plus atol: low
    precision graded as flash-attention's tests grade it. NaN anywhere fails."""
    assert actual.shape == reference.shape, f"{name}: shape {actual.shape} != {reference.shape}"
    error = (actual.double() - reference.double()).abs().max().item()
    torch_error = (baseline.double() - reference.double()).abs().max().item()
    assert error <= factor * torch_error + atol, (
        f"{name}: max error {error:.3g} > {factor} x PyTorch's {torch_error:.3g} + {atol:.3g}")
