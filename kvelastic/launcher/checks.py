"""What ``kvelastic launch`` checks before it starts anything: kvelastic and vLLM in the Python that runs
the servers, a GPU, free ports.

The Python that runs vLLM is asked once, with a short ``-c`` probe run with
the servers' environment (``KVELASTIC=1``, the instance's ``--env``): where
kvelastic imports from, whether vLLM has a way in (the ``.pth`` hook or the
``vllm.general_plugins`` entry point), and which vLLM release is installed
(read from its metadata; vLLM is not imported).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any, Mapping

from kvelastic.launcher.plan import LaunchPlan
from kvelastic.launcher.supervisor import gpu_problem, port_in_use

EXIT_FAILED, EXIT_NO_GPU, EXIT_NO_KVELASTIC, EXIT_UNSUPPORTED_VLLM = 1, 3, 4, 5
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "kvelastic"
# Run by the Python that will run vLLM, with the servers' environment (KVELASTIC=1, so the .pth
# line imports kvelastic._autopatch and wrapt if it is there). Prints one JSON line.
_PLUGIN_PROBE = """
import json, os, sys
out = {"wrapt": "wrapt" in sys.modules, "pth": "kvelastic._autopatch" in sys.modules}
try:
    import kvelastic
    out["where"] = os.path.dirname(kvelastic.__file__)
except Exception as error:
    out["error"] = f"{type(error).__name__}: {error}"
from importlib import metadata
found = metadata.entry_points()
found = found.select(group=GROUP) if hasattr(found, "select") else found.get(GROUP, [])
out["entry_points"] = [e.value for e in found if e.name == NAME]
try:
    out["vllm"] = metadata.version("vllm")
except metadata.PackageNotFoundError:
    out["vllm"] = None
print(json.dumps(out))
""".replace("GROUP", repr(PLUGIN_GROUP)).replace("NAME", repr(PLUGIN_NAME))


def probe_kvelastic(python: str, env: Mapping[str, str]) -> dict[str, Any] | str:
    """What ``python`` with ``env`` has of kvelastic and vLLM (the probe's answer), or why it could not say.

    Runs ``python -c`` with a probe, in this directory (the servers' sys.path
    starts there too); imports neither vLLM nor anything heavy.
    """
    try:
        probe = subprocess.run([python, "-c", _PLUGIN_PROBE], capture_output=True, text=True,
                               timeout=120, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"could not run {python} to look for kvelastic: {error}"
    try:
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} -c <probe> failed (exit {probe.returncode}): {detail}"
    return found


def kvelastic_problem(python: str, env: Mapping[str, str]) -> str | None:
    """Why vLLM run by ``python`` with ``env`` would not load kvelastic, or None when it would.

    kvelastic must import, and vLLM must have a way in, either the ``.pth``
    hook (it ran at interpreter start, wrapt present) or the
    ``vllm.general_plugins`` entry point not left out by ``VLLM_PLUGINS``.
    """
    found = probe_kvelastic(python, env)
    return found if isinstance(found, str) else _missing_kvelastic(python, found, env)


def _missing_kvelastic(python: str, found: dict[str, Any], env: Mapping[str, str]) -> str | None:
    """:func:`kvelastic_problem` for a probe's answer ``found``."""
    install = f"install it there ({python} -m pip install kvelastic, or -e <checkout>) or pass --python"
    if "error" in found:
        return f"kvelastic cannot be imported by {python} ({found['error']}); {install}"
    missing = _missing_hook(found, env.get("VLLM_PLUGINS"), install)
    if missing is None:
        return None
    return (f"kvelastic imports in {python} (from {found['where']}) but vLLM would not load it, so the "
            f"servers would run plain vLLM: {missing}")


def _missing_hook(found: dict[str, Any], allowed: str | None, install: str) -> str | None:
    """What keeps both of vLLM's ways into kvelastic shut, and the fix; None when one is open.

    ``VLLM_PLUGINS`` is vLLM's allow-list of plugin names (comma-separated).
    """
    if found["pth"] and found["wrapt"]:
        return None
    if found["entry_points"] and (allowed is None or PLUGIN_NAME in allowed.split(",")):
        return None
    if found["entry_points"]:
        return (f"VLLM_PLUGINS={allowed!r} leaves out its {PLUGIN_NAME!r} plugin and no .pth hook ran; "
                f"add {PLUGIN_NAME} to VLLM_PLUGINS or unset it")
    if found["pth"]:
        return f"no {PLUGIN_GROUP!r} entry point and its .pth hook needs wrapt, which is missing; install wrapt"
    return (f"no {PLUGIN_GROUP!r} entry point named {PLUGIN_NAME!r} and no kvelastic-autopatch.pth hook "
            f"(it is on sys.path but not installed); {install}")


def vllm_problem(python: str, version: str | None) -> str | None:
    """Why the vLLM ``version`` in ``python`` (None: none installed) cannot run kvelastic; None when it can."""
    from kvelastic.patching.versions import INSTALL_SUPPORTED, SUPPORT_DOC, SUPPORTED, Version

    if version is None:
        return f"vLLM is not installed in {python}; install a supported one there: {INSTALL_SUPPORTED}"
    try:
        supported = Version.parse(version) in SUPPORTED
    except ValueError:
        supported = False
    if supported:
        return None
    return (f"{python} has vLLM {version}, which kvelastic does not support (vLLM {SUPPORTED}; {SUPPORT_DOC}), "
            f"so every server would refuse to start; install a supported one: {INSTALL_SUPPORTED}")


def preflight(plan: LaunchPlan, base_env: Mapping[str, str]) -> tuple[int, str] | None:
    """(exit code, message) when the plan cannot start here; None when it can. Starts nothing."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    for instance in plan.instances:
        if instance.env in seen:
            continue  # the probe's answer depends only on the variables an instance adds
        seen.add(instance.env)
        found = probe_kvelastic(plan.python, {**base_env, **plan.env(instance)})
        problem = found if isinstance(found, str) else _missing_kvelastic(plan.python, found,
                                                                            {**base_env, **plan.env(instance)})
        if problem:
            return EXIT_NO_KVELASTIC, f"kvelastic is not usable by {instance.name}, nothing started: {problem}"
        problem = vllm_problem(plan.python, found["vllm"])  # type: ignore[index]
        if problem:
            return EXIT_UNSUPPORTED_VLLM, f"no supported vLLM for {instance.name}, nothing started: {problem}"
    problem = gpu_problem(dict(base_env), python=plan.python)
    if problem:
        return EXIT_NO_GPU, f"no usable NVIDIA GPU, nothing started: {problem}"
    busy = [str(i.port) for i in plan.instances if port_in_use(i.port)]
    if busy:
        return EXIT_FAILED, f"port(s) {', '.join(busy)} already in use, nothing started"
    return None
