"""KVELASTIC_* settings and byte-size parsing: what is accepted, and what a bad value says."""

from __future__ import annotations

import re

import pytest

from kvelastic.errors import ConfigError
from kvelastic.settings import RETIRED, Settings, describe, known_variables, unknown_variables
from kvelastic.units import SIZE_FORM, align_up, format_size, parse_size

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4


# ----------------------------------------------------------------- parse_size
@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * MIB),
    ("32GiB", 32 * GIB),
    ("1.5GB", 1_500_000_000),
    ("1.5GiB", 3 * GIB // 2),
    ("4096", 4096),
    ("4096B", 4096),
    ("2KB", 2000),
    ("2KiB", 2 * KIB),
    ("3TB", 3 * 10**12),
    ("1 GiB", GIB),
    ("  64mib  ", 64 * MIB),
    ("1.1GB", 1_100_000_000),
    ("0", 0),
    ("0.5KiB", 512),
    ("1tib", TIB),
    ("4gb", 4 * 10**9),
])
def test_sizes_people_write_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "12XB", "", "   ", "1e9", "GiB", "1.GiB", "inf", "nan",
                                  "1,5GiB", "2 G i B"])
def test_garbage_sizes_name_the_variable_and_the_accepted_form(text):
    with pytest.raises(ConfigError) as info:
        parse_size(text, name="KVELASTIC_LIMIT")
    message = str(info.value)
    assert "KVELASTIC_LIMIT" in message
    assert SIZE_FORM in message
    assert "512MiB" in message and "1.5GB" in message


@pytest.mark.parametrize("text, meant", [("4G", "4GiB or 4GB"), ("4g", "4GiB or 4GB"), ("8M", "8MiB or 8MB"),
                                         ("2k", "2KiB or 2KB"), ("1T", "1TiB or 1TB"), ("0.5K", "0.5KiB or 0.5KB")])
def test_a_bare_unit_letter_is_refused_as_ambiguous_naming_the_accepted_units(text, meant):
    with pytest.raises(ConfigError) as info:
        parse_size(text, name="KVELASTIC_LIMIT")
    message = str(info.value)
    assert message.startswith(f"KVELASTIC_LIMIT={text!r}: the unit") and "ambiguous" in message and meant in message
    assert "KiB, MiB, GiB, TiB" in message and "KB, MB, GB, TB" in message


def test_a_fraction_of_a_byte_is_rejected_naming_the_variable():
    with pytest.raises(ConfigError, match="KVELASTIC_LIMIT"):
        parse_size("3.5B", name="KVELASTIC_LIMIT")
    with pytest.raises(ConfigError, match="KVELASTIC_RESERVE"):
        parse_size("0.3", name="KVELASTIC_RESERVE")


def test_a_fraction_of_a_byte_also_names_the_accepted_form():
    with pytest.raises(ConfigError) as info:
        parse_size("3.5B", name="KVELASTIC_LIMIT")
    assert SIZE_FORM in str(info.value)


@pytest.mark.parametrize("text, expected", [("4.1MB", 4_100_000), ("8.3MB", 8_300_000), ("8.2GB", 8_200_000_000)])
def test_exact_decimal_sizes_are_not_lost_to_float_rounding(text, expected):
    assert parse_size(text, name="KVELASTIC_LIMIT") == expected


def test_default_name_in_messages_is_size():
    with pytest.raises(ConfigError, match=r"^size='lots'"):
        parse_size("lots")


# ----------------------------------------------------------- format / align
@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (8 * MIB, "8.00 MiB"), (3 * GIB // 2, "1.50 GiB"), (TIB, "1.00 TiB"), (5 * 1024 * TIB, "5120.00 TiB"),
    (-2048, "-2.00 KiB"),
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize("value, alignment, expected", [
    (0, 4096, 0), (1, 4096, 4096), (4095, 4096, 4096), (4096, 4096, 4096), (4097, 4096, 8192),
    (3 * MIB, 2 * MIB, 4 * MIB), (8 * MIB, 2 * MIB, 8 * MIB), (7, 3, 9),
])
def test_align_up(value, alignment, expected):
    assert align_up(value, alignment) == expected


def test_format_of_a_parsed_size_round_trips():
    for text in ("512MiB", "32GiB", "8MiB", "2TiB"):
        number, unit = float(text[:-3]), text[-3:]
        assert format_size(parse_size(text)) == f"{number:.2f} {unit}"


# ------------------------------------------------------------------- Settings
def test_defaults():
    settings = Settings()
    assert settings.enabled is False
    assert settings.strict is True
    assert settings.chunk_bytes == 8 * MIB
    assert settings.virtual_bytes is None and settings.limit_bytes is None
    assert settings.reserve_bytes == 256 * MIB
    assert settings.prefetch_bytes == GIB
    assert settings.cache_ttl_s == 10.0
    assert settings.cpu_bytes is None and settings.name is None


def test_from_env_reads_only_the_given_mapping(monkeypatch):
    monkeypatch.setenv("KVELASTIC", "banana")
    monkeypatch.setenv("KVELASTIC_LIMIT", "lots")
    assert Settings.from_env({}) == Settings()
    settings = Settings.from_env({
        "KVELASTIC": "1", "KVELASTIC_STRICT": "0", "KVELASTIC_CHUNK_SIZE": "32MiB",
        "KVELASTIC_VIRTUAL_BYTES": "64GiB", "KVELASTIC_LIMIT": "12GiB", "KVELASTIC_RESERVE": "0",
        "KVELASTIC_PREFETCH": "512MiB", "KVELASTIC_CACHE_TTL": "2.5", "KVELASTIC_CPU_BYTES": "100GB",
        "KVELASTIC_NAME": "llama-8b_v2.1", "UNRELATED": "x",
    })
    assert settings == Settings(enabled=True, strict=False, chunk_bytes=32 * MIB, virtual_bytes=64 * GIB,
                                limit_bytes=12 * GIB, reserve_bytes=0, prefetch_bytes=512 * MIB,
                                cache_ttl_s=2.5, cpu_bytes=100 * 10**9, name="llama-8b_v2.1")


def test_from_env_defaults_to_the_process_environment(monkeypatch):
    for variable in Settings.variables():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("KVELASTIC", "1")
    monkeypatch.setenv("KVELASTIC_LIMIT", "3GiB")
    settings = Settings.from_env()
    assert settings.enabled and settings.limit_bytes == 3 * GIB


def test_empty_values_mean_unset():
    assert Settings.from_env({"KVELASTIC_LIMIT": "", "KVELASTIC_CHUNK_SIZE": "  ", "KVELASTIC": ""}) == Settings()


def test_variables_cover_every_field():
    variables = Settings.variables()
    assert set(variables.values()) == {f for f in Settings.__dataclass_fields__}
    assert all(v == "KVELASTIC" or v.startswith("KVELASTIC_") for v in variables)
    assert variables["KVELASTIC_LIMIT"] == "limit_bytes"
    assert variables["KVELASTIC_CHUNK_SIZE"] == "chunk_bytes"


@pytest.mark.parametrize("variable", ["KVELASTIC_LIMIT", "KVELASTIC_VIRTUAL_BYTES", "KVELASTIC_CPU_BYTES",
                                      "KVELASTIC_RESERVE", "KVELASTIC_PREFETCH", "KVELASTIC_CHUNK_SIZE"])
@pytest.mark.parametrize("text", ["lots", "-1GiB", "12XB"])
def test_garbage_size_variables_are_named(variable, text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({variable: text})
    assert variable in str(info.value)
    assert SIZE_FORM in str(info.value)


@pytest.mark.parametrize("variable", ["KVELASTIC_LIMIT", "KVELASTIC_VIRTUAL_BYTES", "KVELASTIC_CPU_BYTES"])
def test_zero_is_no_limit_size(variable):
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env({variable: "0"})


def test_reserve_and_prefetch_may_be_zero():
    settings = Settings.from_env({"KVELASTIC_RESERVE": "0", "KVELASTIC_PREFETCH": "0GiB"})
    assert settings.reserve_bytes == 0 and settings.prefetch_bytes == 0


@pytest.mark.parametrize("text, expected", [("2MiB", 2 * MIB), ("8MiB", 8 * MIB), ("32MiB", 32 * MIB),
                                            ("6MiB", 6 * MIB), ("1GiB", GIB), ("2097152", 2 * MIB)])
def test_chunk_size_accepts_multiples_of_2mib(text, expected):
    assert Settings.from_env({"KVELASTIC_CHUNK_SIZE": text}).chunk_bytes == expected


@pytest.mark.parametrize("text", ["3MiB", "1MiB", "4096", "2MB", "0", "0MiB", "2.5MiB"])
def test_chunk_size_must_be_a_positive_multiple_of_2mib(text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"KVELASTIC_CHUNK_SIZE": text})
    message = str(info.value)
    assert "KVELASTIC_CHUNK_SIZE" in message
    assert "multiple of 2MiB" in message


@pytest.mark.parametrize("variable, field", [("KVELASTIC", "enabled"), ("KVELASTIC_STRICT", "strict")])
@pytest.mark.parametrize("text, expected", [("1", True), ("0", False), ("true", True), ("false", False),
                                            ("TRUE", True), (" False ", False), ("yes", True), ("off", False)])
def test_switches(variable, field, text, expected):
    assert getattr(Settings.from_env({variable: text}), field) is expected


@pytest.mark.parametrize("variable", ["KVELASTIC", "KVELASTIC_STRICT"])
@pytest.mark.parametrize("text", ["banana", "2", "-1", "enabled", "y", "tru"])
def test_bad_switches_name_the_variable(variable, text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({variable: text})
    message = str(info.value)
    assert message.startswith(f"{variable}=")
    assert "use 1 or 0" in message


def test_the_switch_interval_is_seconds_above_zero_and_at_most_one():
    assert Settings().switch_interval_s == 0.0002  # unset: 0.2 ms, measured on an H200 (docs/pool.md)
    assert Settings.from_env({}).switch_interval_s == 0.0002
    assert Settings.from_env({"KVELASTIC_SWITCH_INTERVAL": "0.001"}).switch_interval_s == 0.001
    for text in ("none", " None "):  # Python's own, as the settings line shows it
        assert Settings.from_env({"KVELASTIC_SWITCH_INTERVAL": text}).switch_interval_s is None
    for text in ("0", "2", "-0.001", "1ms", "inf"):
        with pytest.raises(ConfigError, match="KVELASTIC_SWITCH_INTERVAL"):
            Settings.from_env({"KVELASTIC_SWITCH_INTERVAL": text})


@pytest.mark.parametrize("text, expected", [("10", 10.0), ("0.5", 0.5), ("0", 0.0), ("1e3", 1000.0),
                                            (" 30 ", 30.0)])
def test_cache_ttl_seconds(text, expected):
    assert Settings.from_env({"KVELASTIC_CACHE_TTL": text}).cache_ttl_s == expected


@pytest.mark.parametrize("text", ["inf", "Infinity", "1e999", "-inf"])
def test_an_infinite_cache_ttl_is_refused_with_the_way_to_say_never(text):
    with pytest.raises(ConfigError, match=r"KVELASTIC_CACHE_TTL=.* must be a finite number of seconds.*86400"):
        Settings.from_env({"KVELASTIC_CACHE_TTL": text})


@pytest.mark.parametrize("text", ["-1", "-0.5", "ten", "10s", "nan", "1,5"])
def test_bad_cache_ttl_is_named(text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"KVELASTIC_CACHE_TTL": text})
    assert "KVELASTIC_CACHE_TTL" in str(info.value)
    assert "seconds" in str(info.value)


@pytest.mark.parametrize("text, expected", [("llama-8b", "llama-8b"), ("a", "a"), ("A_b.C-9", "A_b.C-9"),
                                            (" padded ", "padded"), ("x" * 64, "x" * 64)])
def test_name_charset(text, expected):
    assert Settings.from_env({"KVELASTIC_NAME": text}).name == expected


@pytest.mark.parametrize("text", ["two words", "a/b", "a:b", "x" * 65, "semi;colon", "star*", "tab\tname",
                                  "modèle", "é" * 40])
def test_bad_names_are_rejected(text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"KVELASTIC_NAME": text})
    message = str(info.value)
    assert "KVELASTIC_NAME" in message
    assert "1-64 ASCII letters, digits" in message


def test_settings_are_immutable():
    settings = Settings()
    with pytest.raises(Exception):
        settings.enabled = True  # type: ignore[misc]


def test_the_host_tier_policy_is_a_choice():
    assert Settings().cpu_policy == "arc"
    assert Settings.from_env({"KVELASTIC_CPU_POLICY": " LRU "}).cpu_policy == "lru"
    with pytest.raises(ConfigError, match=r"KVELASTIC_CPU_POLICY='fifo' is not one of: arc, lru"):
        Settings.from_env({"KVELASTIC_CPU_POLICY": "fifo"})


# ------------------------------------------------- values that cannot work
@pytest.mark.parametrize("text", ["²", "٣", "8001²", "+80", "80.0", "0", "65536"])
def test_a_port_must_be_plain_ascii_digits_in_range(text):
    with pytest.raises(ConfigError, match=r"^KVELASTIC_PORT=.* is not a TCP port"):
        Settings.from_env({"KVELASTIC_PORT": text})
    assert Settings.from_env({"KVELASTIC_PORT": " 8001 "}).port == 8001


@pytest.mark.parametrize("variable", ["KVELASTIC_LIMIT", "KVELASTIC_VIRTUAL_BYTES", "KVELASTIC_SHARED_BUDGET"])
@pytest.mark.parametrize("text", ["1", "1KiB", "4MiB"])
def test_a_size_below_one_chunk_is_refused_naming_the_variable(variable, text):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({variable: text})
    assert str(info.value).startswith(f"{variable}={text!r} is smaller than one chunk (8MiB")
    assert getattr(Settings.from_env({variable: "8MiB"}), Settings.variables()[variable]) == 8 * MIB


def test_one_chunk_is_measured_in_the_configured_chunk_size():
    assert Settings.from_env({"KVELASTIC_LIMIT": "2MiB", "KVELASTIC_CHUNK_SIZE": "2MiB"}).limit_bytes == 2 * MIB
    with pytest.raises(ConfigError, match=r"KVELASTIC_LIMIT='16MiB' is smaller than one chunk \(32MiB"):
        Settings.from_env({"KVELASTIC_LIMIT": "16MiB", "KVELASTIC_CHUNK_SIZE": "32MiB"})


def test_a_reservation_above_the_cap_is_refused():
    with pytest.raises(ConfigError, match=r"KVELASTIC_MIN='2GiB' is larger than KVELASTIC_LIMIT='1GiB'"):
        Settings.from_env({"KVELASTIC_MIN": "2GiB", "KVELASTIC_LIMIT": "1GiB"})
    assert Settings.from_env({"KVELASTIC_MIN": "1GiB", "KVELASTIC_LIMIT": "1GiB"}).min_bytes == GIB


# ------------------------------------------------------ misspelt variables
@pytest.mark.parametrize("typo, meant", [("KVELASTIC_LIMT", "KVELASTIC_LIMIT"),
                                         ("KVELASTIC_CPU_BYTE", "KVELASTIC_CPU_BYTES"),
                                         ("KVELASTIC_CHUNKSIZE", "KVELASTIC_CHUNK_SIZE"),
                                         ("KVELASTIC_SHARED_DIRECTORY", "KVELASTIC_SHARED_DIR")])
def test_a_misspelt_variable_is_named_with_the_nearest_real_one(typo, meant):
    (warning,) = unknown_variables({typo: "8GiB", "KVELASTIC": "1", "KVELASTIC_LIMIT": "8GiB", "PATH": "/bin"})
    assert warning == f"{typo} is not a kvelastic setting and is ignored; did you mean {meant}?"


def test_a_variable_like_nothing_lists_the_settings_and_known_ones_pass():
    (warning,) = unknown_variables({"KVELASTIC_ZZZ": "1"})
    assert warning.startswith("KVELASTIC_ZZZ is not a kvelastic setting") and "KVELASTIC_LIMIT" in warning
    every = {name: "x" for name in known_variables()}
    assert unknown_variables(every) == [] and unknown_variables({"KVELASTICX": "1", "OTHER_LIMT": "1"}) == []


# ------------------------------------------------------ retired variables
def test_a_retired_variable_is_one_warning_saying_what_kvelastic_does_now_never_an_error():
    env = {"KVELASTIC_CPU_LOAD": "sync", "KVELASTIC_COPY_PATH": "fused", "KVELASTIC_LIMIT": "8GiB",
           "KVELASTIC_CPU_PIN": "bogus"}  # not even parsed
    assert unknown_variables(env) == [f"{name} is retired and ignored: {RETIRED[name]}"
                                      for name in ("KVELASTIC_COPY_PATH", "KVELASTIC_CPU_LOAD", "KVELASTIC_CPU_PIN")]
    assert Settings.from_env(env).limit_bytes == 8 * GIB
    assert "KVELASTIC_CPU_LOAD" not in describe(Settings.from_env(env), env)


def test_retired_variables_are_read_by_nothing_and_each_says_one_line():
    assert not set(RETIRED) & set(known_variables())
    assert all(name.startswith("KVELASTIC_") for name in RETIRED)
    assert all(text.strip() and "\n" not in text and len(text) < 100 for text in RETIRED.values())
    assert not any(field in Settings.variables().values() for field in ("copy_path", "cpu_load", "cpu_store",
                                                                          "cpu_pin", "reserve_host_runs_bytes"))


def test_start_up_warns_once_for_each_retired_variable_set(caplog):
    import logging

    from kvelastic.startup.reporting import report_start

    env = {"KVELASTIC_CPU_STORE": "eviction", "KVELASTIC_RESERVE_BUSY_STEP": "1GiB", "KVELASTIC_CPU_BYTES": "1GiB"}
    with caplog.at_level(logging.INFO, logger="vllm.kvelastic"):
        report_start(Settings.from_env(env), env)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"kvelastic: {name} is retired and ignored: {RETIRED[name]}"
                      for name in ("KVELASTIC_CPU_STORE", "KVELASTIC_RESERVE_BUSY_STEP")]


def test_the_retired_lines_state_the_constants_kvelastic_uses():
    """The sizes a retired variable's line states are the constants the code uses."""
    from kvelastic.offload.copier import RUNS_MIN_PIECE_BYTES
    from kvelastic.offload.write_through import AHEAD_SHARE, STEP_BYTES
    from kvelastic.scheduler.reclaimer import BUSY_STEP_BYTES
    from kvelastic.scheduler.reload_reserve import MAX_BYTES

    assert f"{RUNS_MIN_PIECE_BYTES // 1024} KiB" in RETIRED["KVELASTIC_COPY_PATH"]
    assert f"{STEP_BYTES // MIB} MiB" in RETIRED["KVELASTIC_CPU_STORE_STEP"]
    assert AHEAD_SHARE == 4 and "a quarter" in RETIRED["KVELASTIC_CPU_AHEAD"]
    assert f"{BUSY_STEP_BYTES // MIB} MiB" in RETIRED["KVELASTIC_RESERVE_BUSY_STEP"]
    assert f"{MAX_BYTES // GIB} GiB" in RETIRED["KVELASTIC_RESERVE_HOST_RUNS"]


def test_describe_shows_what_is_set_and_the_few_that_matter_on_a_short_line():
    env = {"KVELASTIC": "1", "KVELASTIC_LIMIT": "8GiB", "KVELASTIC_CACHE_TTL": "2.5"}
    line = describe(Settings.from_env(env), env)
    assert "KVELASTIC_LIMIT=8.00GiB*" in line and "KVELASTIC_CACHE_TTL=2.5*" in line
    assert "KVELASTIC_CHUNK_SIZE=8.00MiB " in line and "KVELASTIC_SHARED_BUDGET=none" in line
    assert "KVELASTIC_RESERVE=" not in line and "KVELASTIC_PREFETCH=" not in line  # defaults left out
    assert len(describe(Settings.from_env({}), {})) < 160  # every vLLM process logs it
    every = {v: "x" for v in Settings.variables()}  # set, each is shown, whatever its value
    assert all(f"{v}=" in describe(Settings(), every) for v in Settings.variables() if v != "KVELASTIC")
    for word in line.split():  # every value shown parses back to the same setting
        variable, _, value = word.rstrip("*").partition("=")
        if value != "none":
            assert getattr(Settings.from_env({variable: value}), Settings.variables()[variable]) == \
                getattr(Settings.from_env(env), Settings.variables()[variable]), word


def test_every_variable_the_test_scripts_read_is_known():
    """A variable CI sets in the environment must not reach vLLM as a "not a kvelastic setting" warning."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "scripts" / "run_tests.sh").read_text() + (root / ".ci" / "run").read_text()
    used = set(re.findall(r"KVELASTIC_[A-Z_]+", text))
    assert used, "the test scripts name no KVELASTIC_ variable: this test reads the wrong files"
    assert used <= set(known_variables())


#: The README's settings table: what a user sets. Everything else is in docs/tuning.md.
USER_SETTINGS = ("KVELASTIC", "KVELASTIC_STRICT", "KVELASTIC_LIMIT", "KVELASTIC_MIN", "KVELASTIC_NAME",
                 "KVELASTIC_PORT", "KVELASTIC_CACHE_TTL", "KVELASTIC_CPU_BYTES", "KVELASTIC_CPU_POLICY",
                 "KVELASTIC_SHARED_BUDGET", "KVELASTIC_SHARED_DIR", "KVELASTIC_SHARED_GROUP")


def _table_rows(text: str) -> list[str]:
    return re.findall(r"^\| `(KVELASTIC[A-Z_]*)` \|", text, re.M)


def test_the_readme_table_holds_exactly_the_user_settings_and_tuning_md_every_other():
    """Users learn the settings from README's table, the advanced ones from docs/tuning.md: a variable added
    without a row in one of them is invisible, and the README's table stays at what a user sets."""
    from pathlib import Path

    from kvelastic.settings import _VARIABLES

    root = Path(__file__).resolve().parents[1]
    readme_rows = _table_rows((root / "README.md").read_text())
    tuning_rows = _table_rows((root / "docs" / "tuning.md").read_text())
    assert sorted(readme_rows) == sorted(USER_SETTINGS)
    assert set(USER_SETTINGS) <= {name for name, _ in _VARIABLES.values()}
    missing = [name for name, _ in _VARIABLES.values() if name not in readme_rows and name not in tuning_rows]
    assert missing == []
    assert not set(readme_rows) & set(tuning_rows)


def test_a_retired_variable_is_named_once_with_what_kvelastic_does_instead():
    """A variable kvelastic stopped reading is not an error: start-up says what became of its job."""
    from kvelastic.settings import RETIRED

    mine = {"KVELASTIC_RELEASE": "preempt", "KVELASTIC_TP_CONFIRM": "board", "KVELASTIC_TP_MAP_AFTER_LAUNCH": "0",
            "KVELASTIC_PIPELINE": "refuse", "KVELASTIC_RAY": "refuse"}
    assert set(mine) <= set(RETIRED) and set(RETIRED).isdisjoint(known_variables())
    for variable, now in RETIRED.items():
        (warning,) = unknown_variables({variable: "1", "KVELASTIC": "1"})
        assert warning == f"{variable} is retired and ignored: {now}"
    assert Settings.from_env(mine) == Settings()  # set, they change nothing
    assert len(unknown_variables(mine)) == len(mine)


def _tuning_section(title: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tuning.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_tuning_md_lists_exactly_the_retired_variables():
    """A deployment that still sets a retired variable is warned at start-up and looks it up in docs/tuning.md:
    every name in RETIRED has its row there, and the table names nothing else."""
    assert sorted(_table_rows(_tuning_section("Retired settings"))) == sorted(RETIRED)


def _parse_constant(text: str) -> int:
    number, _, unit = text.partition(" ")
    return int(number) * {"": 1, "KiB": 1024, "MiB": MIB, "GiB": GIB}[unit]


def test_tuning_md_states_the_constants_the_code_uses():
    """The constants table of docs/tuning.md gives each constant's value as the code has it."""
    import importlib

    rows = re.findall(r"^\| `(kvelastic\.[a-z_.]+)\.([A-Z_]+)` \| ([^|]+?) \|", _tuning_section("Constants"), re.M)
    assert {f"{module}.{name}" for module, name, _ in rows} >= {
        "kvelastic.offload.write_through.STEP_BYTES", "kvelastic.offload.write_through.AHEAD_SHARE",
        "kvelastic.offload.copier.STAGING_BYTES", "kvelastic.offload.copier.RUNS_MIN_PIECE_BYTES",
        "kvelastic.offload.manager.LONG_RUN_GROUPS", "kvelastic.scheduler.reload_reserve.MAX_BYTES",
        "kvelastic.scheduler.reclaimer.BUSY_STEP_BYTES"}
    for module, name, value in rows:
        assert getattr(importlib.import_module(module), name) == _parse_constant(value), (module, name, value)
