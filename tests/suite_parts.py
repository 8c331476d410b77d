"""Which test files CI runs once and which in every vLLM band; which run one at a time.

``scripts/run_tests.sh`` runs the suite against several vLLM releases (bands),
each with the torch and transformers releases that vLLM pins. A band proves that
kvelastic works with those releases, so a test belongs to every band when
anything it runs imports one of them, in the test process or in a process it
starts.

``VERSION_FREE`` files import none: their tests reach only kvelastic, the
standard library and packages installed at the same release in every band
(wrapt, PyYAML, rich, numpy, aiohttp, hypothesis, pytest, ...; compared across
the band venvs with ``pip list``). CI runs them once, in the newest band, with
the imports of vllm, torch and transformers made to fail in the test process and
in every Python it starts (``--files=version-free``; conftest.py): a listed file
that starts to depend on a band fails there, loudly, rather than dropping out of
the older bands unseen. The files that use torch without vLLM (the host-backed
page pool, the copiers, the host tier's memory) stay in every band: torch
differs per band (2.11, 2.13, 2.14), and its tensor views, copies and pinned
memory are what they test.

``BAND_TESTS`` are the tests of version-free files that do reach a band's
packages (vLLM; torch, through a kvelastic module that imports it; transformers,
for a tokenizer): they run in every band, and the rest of their file once.

``WALL_CLOCK`` files measure time or race threads and processes against
deadlines (lock waits, reclaim timing, heartbeats, servers that must answer in
time, real engine loops); under two busy xdist workers their margins are not
kept, so they run in a serial pass (``--pace=serial``). A file that flakes under
``-n 2`` belongs here.

The lists name files below ``tests/`` (and ``file::test`` in BAND_TESTS); a file
in none runs in every band, in the parallel pass: the safe default for a new
file. tests/test_suite_parts.py checks that every name exists.
"""

from __future__ import annotations

VERSION_FREE = frozenset({
    "test_arc.py",
    "test_benchmark_drivers.py",
    "test_bench_variants.py",
    "test_cli.py",
    "test_cluster_account.py",
    "test_cluster_source.py",
    "test_fair_share.py",
    "test_free_ledger_single.py",
    "test_host_plan.py",
    "test_host_runs.py",
    "test_launch.py",
    "test_layers.py",
    "test_lock_waits.py",
    "test_metrics.py",
    "test_mm_memory_bound.py",
    "test_multi_model_client.py",
    "test_packaging.py",
    "test_page_alignment.py",
    "test_patch_argument.py",
    "test_pool_benches.py",
    "test_reclaim_sources.py",
    "test_round_baton.py",
    "test_run_proof.py",
    "test_security_attacks.py",
    "test_security_crashes.py",
    "test_security_readers.py",
    "test_settings.py",
    "test_shared_files.py",
    "test_static_check.py",
    "test_suite_parts.py",
    "test_tp_scheduler_side.py",
    "test_version_matrix.py",
})

BAND_TESTS = frozenset({
    "test_host_plan.py::test_an_engine_attached_in_process_runs_its_plan",
    "test_launch.py::test_shipped_tokenizer_matches_the_model_config_and_rebuilds_identically",
    "test_metrics.py::test_vllm_metrics_route_serves_the_engines_numbers",
    "test_packaging.py::test_the_autopatch_of_the_installed_wheel_patches_vllm",
    "test_security_attacks.py::test_attack_1_a_planted_engine_folder_runs_no_code_and_overwrites_nothing",
    "test_security_attacks.py::test_attack_4_an_engine_says_when_other_users_run_kvelastic_beside_it",
    "test_settings.py::test_the_retired_lines_state_the_constants_kvelastic_uses",
    "test_settings.py::test_tuning_md_states_the_constants_the_code_uses",
    "test_version_matrix.py::test_static_check_agrees_with_the_import_gate_on_installed_vllm",
})

WALL_CLOCK = frozenset({
    "test_cluster_resilience.py",  # a stopped member costs the scheduler under 0.5 s
    "test_host_memory.py",  # an admit with no slot ready returns within 0.1 s
    "test_lock_waits.py",  # lock holds and waits measured in tens of milliseconds
    "test_multi_model_client.py",  # CPU rates of spinning processes (flaked under load)
    "test_reclaim_timing.py",  # the engines' own reclaim waits and releases
    "test_security_crashes.py",  # a huge slot count is refused, not read: within 1 s
    "test_security_leases.py",  # a live member's heartbeats, four a second, keep its 1.5 s lease
    "test_shared_files.py",  # a FIFO refused within 1 s; a lock held elsewhere costs under 0.1 s
    "test_tp_rank_failures.py",  # a slow or dead rank holds nothing up: 20 allocations within 1 s
    "test_tp_ray_other_host.py",  # the tick without an engine loop never waits: under 1 s
})
