"""What ``kvelastic launch`` will start: instances, their commands and environments.

A plan is built from the command line or a YAML file and checked whole before
anything starts (names and ports unique, sizes parseable), so a typo never
leaves half a fleet running. Building commands is pure, which is what
``--dry-run`` prints and the tests check.

Each instance runs ``vllm serve`` with the same Python as the launcher and
``KVELASTIC=1``; its kvelastic identity travels in the environment, which the
vLLM integration reads when it joins the GPU's shared account:

``KVELASTIC_NAME``           the instance name (unique among live instances of a GPU)
``KVELASTIC_LIMIT``          its cap of physical KV bytes (``limit``)
``KVELASTIC_MIN``            its reservation (``min``)
``KVELASTIC_PORT``           the API port, shown by ``kvelastic status``
``KVELASTIC_SHARED_BUDGET``  the GPU's shared budget, when given (first instance to join sets it)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvelastic.cluster.errors import LaunchConfigError
from kvelastic.errors import ConfigError
from kvelastic.shared.names import INSTANCE_NAME_FORM, derived_instance_name, is_instance_name
from kvelastic.units import parse_size

DEFAULT_GPU_UTIL = 0.25
DEFAULT_PORTS = (8001, 8002)
# Package data (config and tokenizer, no weights): present in a wheel install as in a checkout.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "llama-1b"
DEFAULT_MODEL_ARGS = ("--load-format", "dummy", "--max-model-len", "4096")


@dataclass(frozen=True)
class Instance:
    """One vLLM server to start."""

    model: str
    port: int
    name: str
    limit: str | None = None
    min: str | None = None
    gpu_memory_utilization: float | None = None
    vllm_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class LaunchPlan:
    """Instances plus what applies to all of them."""

    instances: tuple[Instance, ...]
    budget: str | None = None
    device: str | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_UTIL
    parallel: bool = False
    python: str = field(default_factory=lambda: sys.executable)

    def command(self, instance: Instance) -> list[str]:
        """``vllm serve`` through this Python, with the port and a GPU-memory share."""
        cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", instance.model,
               "--port", str(instance.port)]
        if not _has_flag(instance.vllm_args, "--gpu-memory-utilization"):
            util = instance.gpu_memory_utilization or self.gpu_memory_utilization
            cmd += ["--gpu-memory-utilization", f"{util:g}"]
        return cmd + list(instance.vllm_args)

    def env(self, instance: Instance) -> dict[str, str]:
        """The variables the launcher adds to its own environment for ``instance``."""
        env = {"KVELASTIC": "1", "KVELASTIC_NAME": instance.name, "KVELASTIC_PORT": str(instance.port)}
        if instance.limit is not None:
            env["KVELASTIC_LIMIT"] = instance.limit
        if instance.min is not None:
            env["KVELASTIC_MIN"] = instance.min
        if self.budget is not None:
            env["KVELASTIC_SHARED_BUDGET"] = self.budget
        if self.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.device
        env.update(dict(instance.env))
        return env


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


# ------------------------------------------------------------------ checking
def check_size(text: Any, what: str) -> str:
    """``text`` if it parses as a size (kept as written, for readable environments)."""
    try:
        parse_size(str(text), name=what)
    except ConfigError as error:
        raise LaunchConfigError(str(error)) from None
    return str(text).strip()


def check_util(value: Any, what: str) -> float:
    try:
        util = -1.0 if isinstance(value, bool) else float(value)  # YAML's `yes` is not a fraction
    except (TypeError, ValueError):
        util = -1.0
    if not 0 < util <= 1:
        raise LaunchConfigError(f"{what}={value!r} must be a fraction of GPU memory in (0, 1], e.g. 0.25")
    return util


def default_name(model: str, port: int) -> str:
    """``<model directory name>-<port>``, made a valid instance name whatever the folder is called."""
    return derived_instance_name(Path(model.rstrip("/")).name, port)


def make_instance(*, model: str, port: Any, name: str | None = None, limit: Any = None, min: Any = None,
                  gpu_memory_utilization: Any = None, vllm_args: Sequence[str] = (),
                  env: Mapping[str, Any] | None = None, where: str = "instance") -> Instance:
    """A checked :class:`Instance`; ``where`` names it in error messages."""
    if not model:
        raise LaunchConfigError(f"{where}: needs a model (a path or a Hugging Face id)")
    try:
        port_number = 0 if isinstance(port, (bool, float)) else int(port)
    except (TypeError, ValueError):
        port_number = 0
    if not 0 < port_number < 65536:
        raise LaunchConfigError(f"{where}: port={port!r} must be a TCP port number (1-65535)")
    chosen = name or default_name(model, port_number)
    if not is_instance_name(chosen):
        raise LaunchConfigError(f"{where}: name={chosen!r} must be {INSTANCE_NAME_FORM}")
    return Instance(
        model=model, port=port_number, name=chosen,
        limit=None if limit is None else check_size(limit, f"{where} limit"),
        min=None if min is None else check_size(min, f"{where} min"),
        gpu_memory_utilization=None if gpu_memory_utilization is None
        else check_util(gpu_memory_utilization, f"{where} gpu_memory_utilization"),
        vllm_args=tuple(str(a) for a in vllm_args),
        env=tuple((str(k), str(v)) for k, v in (env or {}).items()))


#: What the launcher sets in each instance's environment, and the option that sets it.
SET_BY_LAUNCHER = {"KVELASTIC": "(always 1)", "KVELASTIC_NAME": "name", "KVELASTIC_PORT": "port",
                   "KVELASTIC_LIMIT": "limit", "KVELASTIC_MIN": "min", "KVELASTIC_SHARED_BUDGET": "budget",
                   "CUDA_VISIBLE_DEVICES": "device"}


def check_env_clashes(plan: LaunchPlan) -> None:
    """Refuse an instance ``env`` that sets a variable the launcher sets from an option (YAML ``limit:`` and
    ``env: {KVELASTIC_LIMIT: ...}``): one of the two would be silently ignored."""
    for instance in plan.instances:
        own = plan.env(replace(instance, env=()))
        for key, _ in instance.env:
            if key in own:
                option = SET_BY_LAUNCHER.get(key, "an option")
                raise LaunchConfigError(f"{instance.name}: env sets {key}, which the launcher sets itself from "
                                        f"{option} ({key}={own[key]}); give it one way only")


def check_plan(plan: LaunchPlan) -> LaunchPlan:
    """Refuse empty plans, clashing names or ports, and variables set twice; return the plan."""
    if not plan.instances:
        raise LaunchConfigError("the launch plan has no instances")
    for attribute in ("name", "port"):
        seen: dict[object, int] = {}
        for index, instance in enumerate(plan.instances, 1):
            value = getattr(instance, attribute)
            if value in seen:
                raise LaunchConfigError(f"instances {seen[value]} and {index} both use {attribute} {value!r}")
            seen[value] = index
    if plan.budget is not None:
        check_size(plan.budget, "budget")
    check_env_clashes(plan)
    return plan


def default_plan(**overrides: Any) -> LaunchPlan:
    """Two instances of the shipped dummy-weight 1B model, on ports 8001 and 8002."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise LaunchConfigError(f"the default model {DEFAULT_MODEL_DIR} is missing (kvelastic installed "
                                f"without its package data?); pass --model PATH --port N")
    instances = tuple(make_instance(model=str(DEFAULT_MODEL_DIR), port=port, vllm_args=DEFAULT_MODEL_ARGS)
                      for port in DEFAULT_PORTS)
    return check_plan(LaunchPlan(instances=instances, **overrides))
