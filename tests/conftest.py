"""Strict JAX for every test: 8 simulated CPU devices, and no silent rank promotion.

(Strict dtype promotion would be stricter still, but optax's own Adam promotes a Python
float against an int32 step count, so it cannot be on here.)

The tests assert numbers, shardings and collectives, never speed, so XLA's CPU backend
skips its expensive LLVM optimisations: compilation, most of the suite's time, halves.
"""

import os

from shardplug.testing.pytest_plugin import compile_fast

# shardplug's own tests see the built-in strategies only, whatever else is installed (the
# example package, say); tests of third-party loading set this themselves.
os.environ["SHARDPLUG_PLUGINS"] = ""
# XLA's CPU backend at its lowest optimisation, and compiled programs kept on disk and shared
# by the test processes (and the commands they start): the same small steps are compiled by
# many tests, and a kept one loads in a quarter of the time it takes to compile (the
# reference transformer's fsdp step: 2.0 s -> 0.5 s).
compile_fast()

# The CPU alone, as the command line's --target needs it (JAX's CUDA plugin, where CI
# installs it for tests/test_targets.py, then compiles for GPUs that are not here).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# The backends start now, with their 8 devices: a command line run in-process first (with
# --devices 2, say) would otherwise start them with its own count for every later test.
jax.devices()


import pytest  # noqa: E402
from helpers import reference_trainer  # noqa: E402


@pytest.fixture
def own_cache(tmp_path):
    """JAX's persistent cache in a folder of this test's, every program written to it."""
    from jax.experimental.compilation_cache import compilation_cache

    config = jax.config
    was = (config.jax_compilation_cache_dir, config.jax_persistent_cache_min_compile_time_secs)
    config.update("jax_compilation_cache_dir", str(tmp_path))
    config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield tmp_path
    config.update("jax_compilation_cache_dir", was[0])
    config.update("jax_persistent_cache_min_compile_time_secs", was[1])
    compilation_cache.reset_cache()


@pytest.fixture
def make_trainer():
    """``make_trainer(model, strategy, adapter=, optimizer=, addons=, **trainer_kwargs)`` ->
    ``(model, trainer)``: the one trainer factory of the suite."""
    return reference_trainer


#: What the README's test command leaves to CI, which runs it next (``python -m pytest -m
#: slow``, in ``.ci/run``): what proves again on Linen and Equinox what the same test proves
#: on NNX (the composition matrices' other rows), what starts real processes (launches,
#: signals) beyond one two-process run, and what runs a whole document or benchmark script.
#: Node-id prefixes; a row's id is matched by the adapter in it.
SLOW = (
    "tests/test_distributed.py::test_two_processes_train_like_one[fsdp]",
    "tests/test_distributed.py::test_two_processes_train_like_one[2d]",
    "tests/test_distributed.py::test_two_processes_train_like_one[pmap]",
    "tests/test_distributed.py::test_a_pipeline_over_two_processes",
    "tests/test_distributed.py::test_two_processes_each_read_half",
    "tests/test_distributed.py::test_killing_a_worker",
    "tests/test_distributed.py::test_ctrl_c_reaches_every_worker",
    "tests/test_distributed.py::test_checkpoints_move_between_process_counts",
    "tests/test_distributed.py::test_a_worker_that_exits_early",
    "tests/test_distributed.py::test_a_coordinator_nobody_serves",
    "tests/test_distributed.py::test_a_second_ctrl_c",
    "tests/test_data.py::test_two_processes_resume",
    "tests/test_checkpoint.py::test_sigkill_in_the_middle_of_a_run",
    "tests/test_checkpoint.py::test_sigterm_finishes_the_step",
    "tests/test_docs.py::test_code_blocks_run[guide.md]",
    "tests/test_commands.py::test_every_command_runs",
    "tests/test_restarts.py::test_chaos_of_every_kind",
    "tests/test_restarts.py::test_a_lost_host_leaves_fewer_processes",
    "tests/test_restarts.py::test_the_frequent_local_tier",
    "tests/test_plugin_guide.py::test_the_guide_builds_a_working_strategy",
    "tests/test_benchmarks.py::test_gpu_mfu",
    "tests/test_benchmarks.py::test_the_hand_written_gpipe",
    "tests/test_benchmarks.py::test_cp_attention_times_the_short_and_plans_the_long",
    "tests/test_benchmarks.py::test_packing_counts_more_real_tokens",
    "tests/test_task.py::test_explain_recommend_bench_and_export_run_on_a_task_file",
    "tests/test_step.py::test_bf16_trains_the_transformer_within_2_percent",
    "tests/test_cp.py::test_a_llama_with_rope_at_1024",
    "tests/test_explain.py::test_explain_prints_a_300_parameter_model",
    "tests/test_pipeline.py::test_pp_checkpoints_resume_under_fsdp",
    "tests/test_conformance_mutants.py::test_a_plugin_of_the_earlier_contract_splitting",
    # the published libraries' models under every strategy but dp (dp's rows, with their
    # weighted losses, in both), and the weighted loss's compositions beyond one cut of each
    # kind (microbatches, devices, a schedule of each engine, pp+dp in both)
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[fsdp-esm2]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[fsdp-griffin]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[tp-esm2]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[tp-griffin]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[fsdp+tp-esm2]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[fsdp+tp-griffin]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[dp+fsdp-esm2]",
    "tests/test_library_models.py::test_a_library_model_trains_like_its_own_loop[dp+fsdp-griffin]",
    "tests/test_weighted_loss.py::test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut[pmap+grad-accum]",
    "tests/test_weighted_loss.py::test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut[pp-interleaved]",
    "tests/test_weighted_loss.py::test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut[pp-zbv]",
    "tests/test_weighted_loss.py::test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut[pp+fsdp+tp]",
    "tests/test_weighted_loss.py::test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut[fsdp+tp]",
)
#: matrices whose Linen and Equinox rows are slow (their NNX rows run in both)
SLOW_ROWS = (
    "tests/test_conformance.py::",
    "tests/test_cp.py::test_compositions_with_cp",
    "tests/test_ep.py::test_compositions_with_ep",
    "tests/test_pipeline.py::test_pipeline_trains_like_one_device",
    "tests/test_users_models.py::test_a_gqa_llama_fed_tokens_minus_one",
    "tests/test_schedules.py::test_every_schedule_trains_like_one_device",
    "tests/test_weighted_loss.py::test_a_weighted_loss_is_the_whole_batchs_in_every_framework",
)


#: The longest tests (a minute or more on 2 cores, from CI's durations), started first, in
#: this order: at the end of a run one of them alone would keep a worker busy for minutes
#: while the other idles. (pytest-xdist hands each worker a block of tests to begin with, so
#: one worker starts on these and the other on the rest; the slow run measured balanced.)
LONG = (
    "tests/test_restarts.py::test_chaos_of_every_kind",
    "tests/test_benchmarks.py::test_the_gpu_check_script",
    "tests/test_commands.py::test_every_command_runs[README.md]",
    "tests/test_restarts.py::test_a_lost_host_leaves_fewer_processes",
    "tests/test_docs.py::test_code_blocks_run[guide.md]",
    "tests/test_float8_addon.py::test_float8_follows_bf16_over_200_steps",
    "tests/test_schedules.py::test_recommend_picks_a_schedule_as_well_as_a_composition",
    "tests/test_restarts.py::test_a_killed_worker_restarts_the_job_from_its_checkpoint",
    "tests/test_lora.py::test_every_framework_fine_tunes_alike_under_fsdp_tp[linen]",
    "tests/test_qlora.py::test_the_command_line_trains_resumes_and_exports_a_quantized_base",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):  # LONG's order, then the rest as collected (a stable sort)
        return next((i for i, p in enumerate(LONG) if item.nodeid.startswith(p)), len(LONG))

    items.sort(key=rank)
    for item in items:
        other_adapter = any(f"{a}-" in item.nodeid or f"-{a}" in item.nodeid
                            for a in ("linen", "equinox"))  # fmt: skip
        if item.nodeid.startswith(SLOW) or (item.nodeid.startswith(SLOW_ROWS) and other_adapter):
            item.add_marker(pytest.mark.slow)
