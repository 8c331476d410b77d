"""The benchmarks' ``--variant`` flag: an A/B of a kvelastic setting in one device call rests on it.

A variant that parsed into the wrong environment would run the baseline twice
under two names and report a difference of noise as the setting's effect.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvelastic.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from variants import parse_variant  # noqa: E402


def test_a_variant_names_a_kvelastic_config_and_the_settings_it_changes() -> None:
    name, env = parse_variant("lean:KVELASTIC_RESERVE=0,KVELASTIC_PREFETCH=64MiB")
    assert name == "kvelastic-lean"
    assert env == {"KVELASTIC_RESERVE": "0", "KVELASTIC_PREFETCH": "64MiB"}
    settings = Settings.from_env(env)  # what the variant's engine will run with
    assert (settings.reserve_bytes, settings.prefetch_bytes) == (0, 64 << 20)


def test_a_variant_may_run_another_kvelastic_tree() -> None:
    name, env = parse_variant("old:PYTHONPATH=/root/kvelastic-old,KVELASTIC_RESERVE=0")
    assert name == "kvelastic-old"
    assert env == {"PYTHONPATH": "/root/kvelastic-old", "KVELASTIC_RESERVE": "0"}


def test_a_variant_without_settings_is_the_baseline_again_under_its_own_name() -> None:
    assert parse_variant("again") == ("kvelastic-again", {})  # an A/A run: the call's own noise


@pytest.mark.parametrize("text", [":KVELASTIC_RESERVE=0", "x:VLLM_FOO=1",
                                  "x:KVELASTIC_RESERVE=0,KVELASTIC_PREFETCH"])
def test_a_malformed_variant_stops_the_benchmark_naming_the_flag(text: str) -> None:
    with pytest.raises(SystemExit, match="--variant"):
        parse_variant(text)
