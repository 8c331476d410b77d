"""Launch plans written as YAML, for fleets too long for one command line.

Either a mapping with shared settings and ``instances``, or just the list::

    budget: 40GiB                 # optional: the GPU's shared KV budget
    device: "0"                   # optional: CUDA_VISIBLE_DEVICES for every instance
    gpu_memory_utilization: 0.25  # optional: default share of GPU memory at start-up
    parallel: false               # optional: start all at once instead of one after another
    instances:
      - model: scripts/models/llama-1b   # relative paths: from the YAML file's directory
        port: 8001
        name: small                      # optional, default <model dir name>-<port>
        limit: 8GiB                      # optional cap of physical KV bytes
        min: 2GiB                        # optional reservation
        gpu_memory_utilization: 0.3      # optional
        vllm_args: [--load-format, dummy]  # list, or one string split like a shell would
        env: {KVELASTIC_CACHE_TTL: "5"}  # optional extra environment

Unknown keys are errors, so a misspelt ``limt`` does not silently mean "no limit",
and values must have their key's type: ``parallel: "no"`` (a string) is refused
rather than read as true, ``port: "8001"`` (a string) rather than read as a
number, and an ``env`` value must be a string, a number or a boolean (written to
the environment as 1 or 0). An ``env`` entry may not set what the launcher sets
from a key (``KVELASTIC_LIMIT`` beside ``limit:``, ``KVELASTIC_NAME``,
``KVELASTIC_PORT``, ...): one of the two would be ignored.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from kvelastic.cluster.errors import LaunchConfigError
from kvelastic.launcher.plan import Instance, LaunchPlan, check_plan, check_size, check_util, make_instance

_TOP_KEYS = {"instances", "budget", "device", "gpu_memory_utilization", "parallel"}
_INSTANCE_KEYS = {"model", "port", "name", "limit", "min", "gpu_memory_utilization", "vllm_args", "env"}


def _model_path(model: Any, base: Path, where: str) -> str:
    """Resolve a relative model path against the YAML file's directory when it exists there."""
    if not isinstance(model, str) or not model.strip():
        raise LaunchConfigError(f"{where}: model must be a path or a Hugging Face id")
    candidate = base / model
    return str(candidate.resolve()) if not Path(model).is_absolute() and candidate.exists() else model


def _vllm_args(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise LaunchConfigError(f"{where}: vllm_args must be a list of strings or one string")


def _env(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LaunchConfigError(f"{where}: env must be a mapping of variable names to values")
    env = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise LaunchConfigError(f"{where}: env key {key!r} must be a variable name")
        if isinstance(item, bool):
            env[key] = "1" if item else "0"
        elif isinstance(item, (str, int, float)):
            env[key] = str(item)
        else:
            raise LaunchConfigError(f"{where}: env {key}={item!r} must be a string, a number or true/false")
    return env


def _typed(entry: dict, key: str, kinds: tuple[type, ...], form: str, where: str) -> None:
    """LaunchConfigError unless ``entry[key]`` (when given) has one of ``kinds``: values keep their key's type,
    so ``port: "8001"`` is refused as ``parallel: "no"`` is. A YAML boolean is never a number."""
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        raise LaunchConfigError(f"{where}: {key}={value!r} must be {form}")


def _switch(value: Any, what: str) -> bool:
    """A YAML boolean (true/false) only: the string "no" is not quietly true."""
    if not isinstance(value, bool):
        raise LaunchConfigError(f"{what}={value!r} must be true or false (unquoted)")
    return value


def _instance(entry: Any, index: int, base: Path) -> Instance:
    where = f"instances[{index}]"
    if not isinstance(entry, dict):
        raise LaunchConfigError(f"{where} must be a mapping with at least model and port")
    unknown = sorted(set(entry) - _INSTANCE_KEYS)
    if unknown:
        raise LaunchConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(_INSTANCE_KEYS))}")
    if "port" not in entry:
        raise LaunchConfigError(f"{where}: needs a port")
    _typed(entry, "port", (int,), "a TCP port number, unquoted (port: 8001)", where)
    _typed(entry, "gpu_memory_utilization", (int, float), "a fraction of GPU memory, unquoted (0.25)", where)
    _typed(entry, "name", (str,), "text", where)
    for key in ("limit", "min"):
        _typed(entry, key, (str, int), "a size such as 8GiB, or a byte count", where)
    env = _env(entry.get("env"), where)
    return make_instance(model=_model_path(entry.get("model"), base, where), port=entry["port"],
                         name=entry.get("name"), limit=entry.get("limit"), min=entry.get("min"),
                         gpu_memory_utilization=entry.get("gpu_memory_utilization"),
                         vllm_args=_vllm_args(entry.get("vllm_args"), where), env=env, where=where)


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise LaunchConfigError("reading a YAML launch file needs PyYAML (pip install pyyaml)") from None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise LaunchConfigError(f"cannot read launch file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise LaunchConfigError(f"launch file {path} is not valid YAML: {error}") from None


def load_plan(path: str | Path, **overrides: Any) -> LaunchPlan:
    """The plan a YAML file describes; ``overrides`` (from the command line) win over its settings."""
    path = Path(path)
    data = _read_yaml(path)
    if isinstance(data, list):
        data = {"instances": data}
    if not isinstance(data, dict) or not isinstance(data.get("instances"), list):
        raise LaunchConfigError(f"launch file {path}: expected a list of instances, or a mapping with "
                                f"'instances: [...]'")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise LaunchConfigError(f"launch file {path}: unknown key(s) {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(_TOP_KEYS))}")
    base = path.resolve().parent
    settings: dict[str, Any] = {}
    if data.get("budget") is not None:
        settings["budget"] = check_size(data["budget"], "budget")
    if data.get("device") is not None:
        if isinstance(data["device"], bool) or not isinstance(data["device"], (str, int)):
            raise LaunchConfigError(f"launch file {path}: device={data['device']!r} must be GPU ids like \"0\" "
                                    f"or \"0,1\" (CUDA_VISIBLE_DEVICES)")
        settings["device"] = str(data["device"])
    if data.get("gpu_memory_utilization") is not None:
        _typed(data, "gpu_memory_utilization", (int, float), "a fraction of GPU memory, unquoted (0.25)",
               f"launch file {path}")
        settings["gpu_memory_utilization"] = check_util(data["gpu_memory_utilization"], "gpu_memory_utilization")
    if data.get("budget") is not None:
        _typed(data, "budget", (str, int), "a size such as 40GiB, or a byte count", f"launch file {path}")
    if data.get("parallel") is not None:
        settings["parallel"] = _switch(data["parallel"], f"launch file {path}: parallel")
    settings.update({k: v for k, v in overrides.items() if v is not None})
    instances = tuple(_instance(entry, i, base) for i, entry in enumerate(data["instances"]))
    return check_plan(LaunchPlan(instances=instances, **settings))
