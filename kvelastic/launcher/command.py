"""Start several kvelastic-enabled vLLM servers on one GPU: ``kvelastic launch``.

Instances come from the command line, one group of options per instance,
groups separated by ``--and``; arguments after ``--`` in a group go to that
instance's ``vllm serve``::

    kvelastic launch --model m1 --port 8001 --limit 8GiB -- --max-model-len 4096 \\
                     --and --model m2 --port 8002 --min 2GiB

or from a YAML file (``--config fleet.yaml``, format in
:mod:`kvelastic.launcher.plan_file`). With neither, it starts two instances of
the dummy-weight model shipped inside the package (``kvelastic/models/llama-1b``:
a Llama-3.2-1B config and a small tokenizer) on ports 8001 and 8002. Launcher
options (``--dry-run``, ``--budget``, ...) go in the first group. Relative
paths (``--config``, ``--model``, ``--log-dir``, ``--python``) are the
caller's: they are resolved against the current directory.

Every instance's environment (the caller's, plus what the launcher and
``--env`` add) is read with kvelastic's own settings parser before anything
starts, ``--dry-run`` included: a value a server would refuse (``--limit 0``,
``--env KVELASTIC_CACHE_TTL=soon``) is refused here, and a ``KVELASTIC_*``
name nothing reads is named with the nearest real one.

Each server gets ``--gpu-memory-utilization 0.25`` unless told otherwise. With
kvelastic the KV cache is virtual and maps memory only as it is used, so this
share only has to cover weights, activations and CUDA graphs at start-up; vLLM
refuses to start when less than this share is free on the GPU, so it must fit
beside what the servers already running hold. Servers start one after another
(``--parallel`` starts them together), which also keeps one server's memory
from moving while the next one profiles.

Before starting anything it checks that the Python which will run vLLM has
kvelastic installed with a hook vLLM runs (the ``vllm.general_plugins`` entry
point or the ``kvelastic-autopatch.pth`` line): without one the servers would
silently run plain vLLM and never join the GPU's account; and that it has a
vLLM release kvelastic supports, which every server would otherwise refuse at
start.

Ctrl-C (SIGINT) and SIGTERM stop everything from the first moment, even when
the launcher was started with SIGINT ignored (a background job of a
non-interactive shell).

Exit codes: 0 stopped on request; 1 a server failed or never became ready;
2 bad arguments or launch file; 3 no usable GPU; 4 kvelastic is not installed
in the Python that runs vLLM; 5 that Python has no vLLM, or one kvelastic does
not support (nothing was started in the last three cases).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvelastic.cluster.errors import LaunchConfigError
from kvelastic.launcher.plan import (Instance, LaunchPlan, check_plan, check_size, check_util, default_plan,
                                    make_instance)
from kvelastic.launcher.supervisor import STOP_SIGNALS, Supervisor
from kvelastic.errors import ConfigError
from kvelastic.launcher.checks import (EXIT_FAILED, EXIT_NO_GPU, EXIT_NO_KVELASTIC, EXIT_UNSUPPORTED_VLLM,  # noqa: F401
                                     kvelastic_problem, preflight, vllm_problem)
from kvelastic.settings import Settings, unknown_variables

PROG = "kvelastic launch"
SEPARATOR = "--and"
MAX_TIMEOUT_S = 7 * 86400.0
EXIT_OK, EXIT_USAGE = 0, 2  # the others: kvelastic.launcher.checks
DESCRIPTION = "Start several kvelastic-enabled vLLM servers on one GPU."
EPILOG = (f"Instances: one group of instance options each, groups separated by {SEPARATOR}; arguments after -- "
          f"in a group go to that instance's vllm serve. Launcher options go in the first group. Exit codes: 0 "
          f"stopped on request, 1 a server failed, 2 bad arguments, 3 no usable GPU, 4 kvelastic not installed "
          f"in the Python that runs vLLM, 5 no supported vLLM there.")
def _instance_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instance (repeat the group after --and)")
    group.add_argument("--model", help="model path or Hugging Face id")
    group.add_argument("--port", help="API port")
    group.add_argument("--name", help="instance name (KVELASTIC_NAME); default <model dir>-<port>")
    group.add_argument("--limit", metavar="SIZE", help="cap of physical KV bytes, e.g. 8GiB")
    group.add_argument("--min", metavar="SIZE", help="reserved physical KV bytes, e.g. 2GiB")
    group.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                       help="extra environment variable (repeatable)")


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(parser of the first group: launcher + instance options, parser of later groups)."""
    first = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    first.add_argument("--config", metavar="FILE.yaml", help="launch file (instead of --model groups)")
    first.add_argument("--dry-run", action="store_true", help="print commands and environment, start nothing")
    first.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    first.add_argument("--budget", metavar="SIZE", help="the GPU's shared KV budget (KVELASTIC_SHARED_BUDGET)")
    first.add_argument("--device", metavar="IDS", help="CUDA_VISIBLE_DEVICES for every instance")
    first.add_argument("--gpu-util", type=float, metavar="FRACTION",
                       help="default --gpu-memory-utilization of every instance (default 0.25)")
    first.add_argument("--parallel", action="store_true", default=None, help="start all instances at once")
    first.add_argument("--python", metavar="PATH", help="Python that runs vLLM (default: this one)")
    first.add_argument("--log-dir", metavar="DIR", help="server logs (default: a new temporary directory)")
    first.add_argument("--startup-timeout", type=_seconds(above_zero=True), default=900.0, metavar="S",
                       help="seconds each server may take to become ready (default 900)")
    first.add_argument("--stop-timeout", type=_seconds(above_zero=False), default=30.0, metavar="S",
                       help="seconds between SIGTERM and SIGKILL when stopping (default 30)")
    _instance_options(first)
    later = argparse.ArgumentParser(prog=f"{PROG} ... {SEPARATOR}", add_help=False)
    _instance_options(later)
    return first, later


def _seconds(*, above_zero: bool) -> Any:
    """An argparse type: finite seconds, at least 0 (or above 0), at most a week; NaN and infinities refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (0 < value if above_zero else 0 <= value) or not value <= MAX_TIMEOUT_S:
            least = "above 0" if above_zero else "0 or more"
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {least} and at most "
                                             f"{MAX_TIMEOUT_S:g}")
        return value

    return parse


def split_groups(argv: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """Split ``argv`` on ``--and`` into (options, vllm args after ``--``) per group."""
    groups: list[list[str]] = [[]]
    for token in argv:
        if token == SEPARATOR:
            groups.append([])
        else:
            groups[-1].append(token)
    result = []
    for tokens in groups:
        cut = tokens.index("--") if "--" in tokens else len(tokens)
        result.append((tokens[:cut], tokens[cut + 1:]))
    return result


def _env_pairs(items: list[str], where: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchConfigError(f"{where}: --env {item!r} must look like VAR=VALUE")
        pairs[key] = value
    return pairs


def _group_instance(ns: argparse.Namespace, vllm_args: list[str], index: int) -> Instance | None:
    where = f"instance {index + 1}"
    if ns.model is None:
        given = [f"--{k}" for k in ("port", "name", "limit", "min") if getattr(ns, k) is not None]
        if index == 0 and not given and not vllm_args and not ns.env:
            return None
        raise LaunchConfigError(f"{where}: needs --model (and --port)")
    if ns.port is None:
        raise LaunchConfigError(f"{where}: needs --port")
    return make_instance(model=caller_path(ns.model), port=ns.port, name=ns.name, limit=ns.limit, min=ns.min,
                         vllm_args=vllm_args, env=_env_pairs(ns.env, where), where=where)


def caller_path(text: str | None) -> str | None:
    """``text`` as an absolute path when it names something in the caller's directory; else unchanged.

    A model that is not a local path is a Hugging Face id and stays as written.
    Symbolic links are kept: a venv's ``bin/python`` only works under its own name.
    """
    if text is None or not Path(text).exists():
        return text
    return os.path.abspath(text)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, LaunchPlan]:
    """The launcher options and the checked plan (LaunchConfigError or SystemExit(2) on bad input)."""
    first, later = build_parsers()
    groups = split_groups(argv)
    options = first.parse_args(groups[0][0])
    namespaces = [options] + [later.parse_args(tokens) for tokens, _ in groups[1:]]
    instances = [_group_instance(ns, vargs, i) for i, (ns, (_, vargs)) in enumerate(zip(namespaces, groups))]
    util = None if options.gpu_util is None else check_util(options.gpu_util, "--gpu-util")
    settings: dict[str, Any] = {
        "budget": check_size(options.budget, "--budget") if options.budget else None,
        "device": options.device, "parallel": options.parallel, "python": caller_path(options.python),
        "gpu_memory_utilization": util}
    settings = {k: v for k, v in settings.items() if v is not None}
    explicit = [i for i in instances if i is not None]
    if options.config:
        if explicit:
            raise LaunchConfigError("give instances either with --model or in --config, not both")
        from kvelastic.launcher.plan_file import load_plan

        return options, load_plan(options.config, **settings)
    if not explicit:
        return options, default_plan(**settings)
    return options, check_plan(LaunchPlan(instances=tuple(explicit), **settings))


def describe(plan: LaunchPlan, as_json: bool) -> str:
    """What ``--dry-run`` prints: per instance, its URL, added environment and command."""
    if as_json:
        instances = [{"name": i.name, "model": i.model, "port": i.port, "url": i.url, "env": plan.env(i),
                      "command": plan.command(i)} for i in plan.instances]
        return json.dumps({"parallel": plan.parallel, "budget": plan.budget, "device": plan.device,
                           "instances": instances}, indent=2)
    lines = []
    for instance in plan.instances:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env(instance).items())
        lines += [f"# {instance.name}: {instance.url}", f"{env} {shlex.join(plan.command(instance))}"]
    return "\n".join(lines)


# ------------------------------------------------------------ pre-flight
def check_environments(plan: LaunchPlan, base_env: Mapping[str, str]) -> list[str]:
    """Warnings about ``KVELASTIC_*`` names nothing reads; LaunchConfigError for a value a server would refuse.

    Each instance's environment is parsed as its vLLM processes will parse it.
    Names from the caller's environment are reported once, names an instance
    adds (``--env``, YAML ``env``) once per instance.
    """
    warnings = [f"your environment: {w}" for w in unknown_variables(base_env)]
    for instance in plan.instances:
        try:
            Settings.from_env({**base_env, **plan.env(instance)})
        except ConfigError as error:
            raise LaunchConfigError(f"{instance.name}: {error}") from None
        warnings += [f"{instance.name}: {w}" for w in unknown_variables(dict(instance.env))]
    return warnings


# --------------------------------------------------------------- signals
def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def install_stop_signals() -> dict[int, Any]:
    """Make Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt from now on; return the handlers replaced.

    A shell starts a background job with SIGINT ignored, and Python keeps an
    ignored SIGINT ignored, so Ctrl-C (or ``kill -INT``) would do nothing; the
    default SIGTERM and SIGHUP (a closed terminal) would kill the launcher and
    leave its servers running in their own sessions. SIGHUP stays ignored under
    ``nohup``. Done first thing in :func:`main`, before the slow GPU probe.
    """
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous  # only the main thread may set handlers; an embedding caller keeps its own
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _interrupt)
    return previous


def _set_handlers(handlers: dict[int, Any]) -> None:
    """Install ``handlers`` (as returned by :func:`install_stop_signals`); main thread only."""
    if threading.current_thread() is threading.main_thread():
        for signum, handler in handlers.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def supervise(supervisor: Supervisor) -> int:
    """Run the fleet, and make sure it is stopped whatever ends the run.

    A stop request while stopping kills what is left at once (and further ones
    are ignored); output that can no longer be written (a closed terminal or
    pipe) must not leave the servers running, so they are stopped silently.
    """
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        _set_handlers({s: signal.SIG_IGN for s in STOP_SIGNALS})
        supervisor.stop_timeout_s = 0.0
        code = EXIT_OK
    except OSError:  # printing failed (EPIPE, EIO) before or while stopping
        code = EXIT_FAILED
    try:
        supervisor.stop_all()
    except OSError:
        supervisor.out = open(os.devnull, "w")  # noqa: SIM115 - lives until the process exits
        supervisor.stop_all()
    return code


# ------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (see the module docstring)."""
    previous = install_stop_signals()
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        _set_handlers(previous)


def _main(argv: Sequence[str]) -> int:
    try:
        options, plan = parse(argv)
        for warning in check_environments(plan, os.environ):
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
    except LaunchConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if options.dry_run:
        print(describe(plan, options.json))
        return EXIT_OK
    try:
        refused = preflight(plan, os.environ)
        if refused:
            print(f"{PROG}: {refused[1]}", file=sys.stderr)
            return refused[0]
        log_dir = Path(os.path.abspath(options.log_dir) if options.log_dir
                       else tempfile.mkdtemp(prefix=time.strftime("kvelastic-%Y%m%d-%H%M%S-")))
        supervisor = Supervisor(plan, log_dir, startup_timeout_s=options.startup_timeout,
                                stop_timeout_s=options.stop_timeout)
    except KeyboardInterrupt:  # the probes' children are killed by subprocess.run on the way out
        print(f"{PROG}: stopped before anything started", file=sys.stderr)
        return EXIT_OK
    return supervise(supervisor)


if __name__ == "__main__":
    sys.exit(main())
