"""The ``kvelastic`` command: see and steer the kvelastic instances sharing a GPU.

``kvelastic status`` lists every live instance of every GPU account in the
shared directory (``/dev/shm``, or ``$KVELASTIC_SHARED_DIR``); ``kvelastic
limit`` changes an instance's cap or reservation in the account file, which
the instance re-reads on its next upkeep tick (a few times a second);
``kvelastic budget`` shows or changes a GPU's shared budget. Nothing
here imports torch or vLLM, so the command answers instantly.

``kvelastic limit NAME none`` (or ``--reset``) puts back the cap the instance
started with (vLLM's profiled KV size, or ``KVELASTIC_LIMIT``), which every
member keeps in its record: an engine is sized around that cap at start-up, so
a reset must never let it grow over the whole GPU.

``kvelastic reset GPU`` removes a corrupt account (``--force``: any); running
engines rejoin a fresh one. Only this user's (or group's) folder is read, and
names from it are shown without control characters (``docs/security.md``).

``kvelastic launch`` starts kvelastic-enabled vLLM servers on one GPU (see
:mod:`kvelastic.launcher.command`, which has its own options and exit codes);
``kvelastic top`` is a live view of the instances' memory (:mod:`kvelastic.top`).

``--gpu`` takes the id ``kvelastic status`` shows, the GPU's UUID as
``nvidia-smi -L`` prints it, or its index as nvidia-smi numbers them
(:mod:`kvelastic.gpu_ids`).

Exit codes: 0 ok; 2 bad usage or a bad size; 3 unknown instance name; 4 no
account or no live instance (``status --json`` still prints an empty list);
5 not allowed (read-only account, unsafe folder, another user's file); 6
``status`` found an account it cannot read; 141 the reader of the output went
away (``kvelastic status | head``), as for any tool stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

from kvelastic import __version__, top
from kvelastic.cluster import (AccountNotFound, BadLimits, ClusterError, MemberInfo, SharedAccount,
                               account_path, find_account_paths, shared_dir)
from kvelastic.cluster.errors import AccountBusy, AccountInUse, AccountNotOwned, AccountNotWritable
from kvelastic.cluster.reset import reset_account
from kvelastic.cli_input import (EXIT_CORRUPT, EXIT_DENIED, EXIT_NONE, EXIT_OK, EXIT_PIPE_CLOSED,  # noqa: F401
                                 EXIT_UNKNOWN, EXIT_USAGE, MAX_INTERVAL_S, RESTORE_START_CAP, CliError,
                                 check_gpu_text, check_one_chunk, negative_size, parse_limit, parse_max,
                                 seconds_argument)
from kvelastic.errors import ConfigError
from kvelastic.gpu_ids import UnknownGpu, account_gpu_id
from kvelastic.shared.errors import SharedFileError
from kvelastic.shared.names import INSTANCE_NAME_FORM, gpu_of_account, is_instance_name
from kvelastic.shared.sweep import sweep_scope
from kvelastic.shared.text import printable
from kvelastic.status_view import render_table, snapshot
from kvelastic.units import SIZE_FORM, format_size, parse_size

_EXIT_CODES = ((ConfigError, EXIT_USAGE), (AccountInUse, EXIT_USAGE),
               ((AccountNotWritable, AccountNotOwned, SharedFileError), EXIT_DENIED), (ClusterError, EXIT_NONE))


# ----------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvelastic", description="Inspect and steer kvelastic instances "
                                     "sharing GPUs (accounts in $KVELASTIC_SHARED_DIR or /dev/shm).")
    parser.add_argument("--version", action="version", version=f"kvelastic {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("launch", add_help=False, help="start kvelastic-enabled vLLM servers on one GPU "
                   "(kvelastic launch --help)")
    status = sub.add_parser("status", help="list live instances and their KV memory")
    status.add_argument("--gpu", metavar="ID", help="only this GPU's account: its id, UUID or nvidia-smi "
                        "index (default: every account found)")
    status.add_argument("--json", action="store_true", help="machine-readable output (bytes as integers)")
    status.add_argument("--watch", nargs="?", type=seconds_argument, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    top.add_parser(sub)
    limit = sub.add_parser("limit", help="change an instance's cap (max) and/or reservation (min)",
                           description="Sizes: " + SIZE_FORM + ". A max of 'none' (or --reset) puts back "
                           "the cap the instance started with (vLLM's profiled KV size, or KVELASTIC_LIMIT); "
                           "an instance never runs without a cap. A min of 'none' is 0.")
    limit.add_argument("name", metavar="NAME", help="instance name (KVELASTIC_NAME)")
    limit.add_argument("size", nargs="?", metavar="MAX", help="new cap, same as --max")
    limit.add_argument("--max", dest="max", metavar="SIZE", help="new cap, or 'none' to restore the start-up cap")
    limit.add_argument("--reset", action="store_true", help="restore the start-up cap (same as --max none)")
    limit.add_argument("--min", dest="min", metavar="SIZE", help="new reservation, or 'none' for 0")
    limit.add_argument("--gpu", metavar="ID", help="only this GPU's account (default: every account "
                       "that has NAME; an instance spread over several GPUs gets the limit on each)")
    budget = sub.add_parser("budget", help="show or change a GPU's shared KV budget",
                            description="Sizes: " + SIZE_FORM + ".")
    budget.add_argument("size", nargs="?", metavar="SIZE", help="new budget (omit to show)")
    budget.add_argument("--gpu", metavar="ID", help="the GPU's account (needed to change it when "
                        "there are several)")
    reset = sub.add_parser("reset", help="remove a GPU's account (corrupt, or with --force any); running "
                           "instances create and join a fresh one")
    reset.add_argument("gpu", metavar="GPU", help="the GPU id, as `kvelastic status` shows it")
    reset.add_argument("--force", action="store_true", help="reset an account that is readable and has "
                       "live instances too (their limits set with `kvelastic limit` are lost)")
    return parser


# ------------------------------------------------------------------ accounts
def open_accounts(gpu: str | None, broken: list[dict] | None = None) -> list[SharedAccount]:
    """The account of ``gpu``, or every account in the shared directory; CliError(4) if none.

    Accounts that cannot be read are added to ``broken`` (for ``status`` to
    show) or, without it, named on stderr and skipped.
    """
    where = shared_dir()
    gpu = resolve_gpu(gpu) if gpu is not None else None
    paths = [account_path(gpu)] if gpu else find_account_paths()
    accounts = []
    for path in paths:
        try:
            accounts.append(SharedAccount.attach(path))
        except AccountNotFound:
            continue
        except (ClusterError, SharedFileError, OSError) as error:
            problem = printable(str(error))
            if broken is None:
                print(f"kvelastic: skipping {printable(str(path))}: {problem}", file=sys.stderr)
            else:
                broken.append({"gpu": printable(gpu_of_account(path.name)), "path": printable(str(path)),
                               "error": problem, "busy": isinstance(error, AccountBusy)})
    if not accounts and not broken:
        what = f"for GPU {gpu!r}" if gpu else "of any GPU"
        raise CliError(f"kvelastic: no account {what} in {where} (is a kvelastic instance running as this "
                       f"user? Accounts are per user, or per KVELASTIC_SHARED_GROUP; KVELASTIC_SHARED_DIR "
                       f"sets the directory)", EXIT_NONE)
    return accounts


def read_accounts(gpu: str | None, broken: list[dict] | None = None) -> list[dict]:
    """:func:`open_accounts`, read once (``status_view.snapshot``) and closed again: what ``status`` and
    ``top`` show. Errors as :func:`open_accounts`."""
    accounts = open_accounts(gpu, broken)
    try:
        return snapshot(accounts)
    finally:
        for account in accounts:
            account.close()


def resolve_gpu(text: str) -> str:
    """The account id of ``--gpu``: as ``status`` shows it, an nvidia-smi UUID, or an index (CliError(2))."""
    check_gpu_text(text, "--gpu")
    if account_path(text).exists():
        return text
    try:
        return account_gpu_id(text)
    except UnknownGpu as error:
        raise CliError(f"kvelastic: --gpu {text}: {error}", EXIT_USAGE) from None


def status_once(gpu: str | None, as_json: bool) -> int:
    sweep_scope()
    broken: list[dict] = []
    try:
        data = read_accounts(gpu, broken)
    except CliError as error:
        if as_json and error.code == EXIT_NONE:  # a script still gets JSON it can parse
            print(json.dumps({"accounts": []}, indent=2))
        raise
    data += broken
    print(json.dumps({"accounts": data}, indent=2) if as_json else render_table(data))
    if broken:
        print(f"kvelastic: {len(broken)} account(s) cannot be read (see above)", file=sys.stderr)
        return EXIT_CORRUPT
    if not any(acct["members"] for acct in data):
        print("kvelastic: no live kvelastic instances", file=sys.stderr)
        return EXIT_NONE
    return EXIT_OK


def status_watch(gpu: str | None, as_json: bool, seconds: float) -> int:
    """Redraw the status every ``seconds`` until Ctrl-C; missing accounts are shown, not fatal."""
    if not 0 < seconds <= MAX_INTERVAL_S:
        raise CliError(f"kvelastic status: --watch={seconds:g} must be a number of seconds above 0 and at most "
                       f"{MAX_INTERVAL_S:g}", EXIT_USAGE)
    clear = sys.stdout.isatty() and not as_json
    try:
        while True:
            if clear:
                sys.stdout.write("\x1b[H\x1b[2J")
            print(time.strftime("%H:%M:%S"), f"(every {seconds:g}s, Ctrl-C to stop)")
            try:
                status_once(gpu, as_json)
            except CliError as error:
                print(str(error), file=sys.stderr)
            sys.stdout.flush()
            time.sleep(seconds)
    except KeyboardInterrupt:
        return EXIT_OK


# --------------------------------------------------------------------- limit
def limit(name: str, max_bytes: int | None, min_bytes: int | None, gpu: str | None) -> int:
    """Change NAME's limits on every GPU it runs on (``max_bytes=RESTORE_START_CAP``: its start-up cap)."""
    if not is_instance_name(name):
        raise CliError(f"kvelastic limit: NAME={printable(repr(name))} is not an instance name: names are "
                       f"{INSTANCE_NAME_FORM}", EXIT_USAGE)
    if max_bytes is None and min_bytes is None:
        raise CliError("kvelastic limit: give a new MAX (or --max SIZE|none, --reset) and/or --min SIZE|none",
                       EXIT_USAGE)
    accounts = open_accounts(gpu)
    changed, live = [], set()
    try:
        for account in accounts:
            names = {m.name for m in account.members()}
            live |= names
            if name in names:
                changed.append((account.gpu_id, _change(account, name, max_bytes, min_bytes)))
    finally:
        for account in accounts:
            account.close()
    if not changed:  # names read from the account are shown as `status` shows them: never terminal codes
        known = ", ".join(sorted(printable(n) for n in live)) or "none"
        raise CliError(f"kvelastic limit: no live instance called {name!r} (live instances: {known})",
                       EXIT_UNKNOWN)
    for gpu_id, info in changed:
        print(f"{name} on GPU {printable(gpu_id)}: max {_cap(info)}, min {format_size(info.min_bytes)} "
              f"(holds {format_size(info.mapped_bytes)})")
    return EXIT_OK


def _change(account: SharedAccount, name: str, max_bytes: int | None, min_bytes: int | None) -> MemberInfo:
    try:
        if max_bytes == RESTORE_START_CAP:
            return account.restore_max(name, min_bytes=min_bytes)
        return account.set_limits(name, min_bytes=min_bytes, max_bytes=max_bytes)
    except BadLimits as error:
        raise CliError(f"kvelastic limit: {error}", EXIT_USAGE) from None


def _cap(info: MemberInfo) -> str:
    if not info.max_bytes:
        return "none"
    start = " (its start-up cap)" if info.max_bytes == info.start_max_bytes else ""
    return format_size(info.max_bytes) + start


# -------------------------------------------------------------------- budget
def budget(size: str | None, gpu: str | None) -> int:
    new = None
    if size is not None:
        try:
            new = parse_size(size, name="SIZE")
        except ConfigError as error:
            raise CliError(f"kvelastic budget: {error}", EXIT_USAGE) from None
        if new <= 0:
            raise CliError(f"kvelastic budget: SIZE={size!r} must be larger than zero", EXIT_USAGE)
        check_one_chunk(new, f"kvelastic budget: SIZE={size!r}")
    accounts = open_accounts(gpu)
    try:
        if new is not None and len(accounts) > 1:
            gpus = ", ".join(a.gpu_id for a in accounts)
            raise CliError(f"kvelastic budget: several GPUs ({gpus}); choose one with --gpu", EXIT_USAGE)
        for account in accounts:
            if new is not None:
                try:
                    account.set_budget(new)
                except BadLimits as error:
                    raise CliError(f"kvelastic budget: {error}", EXIT_USAGE) from None
            print(f"GPU {printable(account.gpu_id)}: budget {format_size(account.budget)}")
    finally:
        for account in accounts:
            account.close()
    return EXIT_OK


# --------------------------------------------------------------------- reset
def reset(gpu: str, force: bool) -> int:
    check_gpu_text(gpu, "GPU")
    path, problem = reset_account(gpu, force=force)
    if problem is not None:
        print(f"kvelastic reset: it could not be read: {printable(problem)}", file=sys.stderr)
    print(f"GPU {printable(gpu)}: account {printable(str(path))} removed; running instances create and join a "
          f"fresh one within a second")
    return EXIT_OK


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    if args.command == "status":
        if args.watch is not None:
            return status_watch(args.gpu, args.json, args.watch)
        return status_once(args.gpu, args.json)
    if args.command == "budget":
        return budget(args.size, args.gpu)
    if args.command == "reset":
        return reset(args.gpu, args.force)
    if args.command == "top":
        return top.main(args)
    given = [flag for flag, value in (("MAX", args.size), ("--max", args.max), ("--reset", args.reset or None))
             if value is not None]
    if len(given) > 1:
        raise CliError(f"kvelastic limit: give the new max one way only (MAX, --max or --reset), "
                       f"not as {' and '.join(given)}", EXIT_USAGE)
    if args.reset:
        max_bytes: int | None = RESTORE_START_CAP
    else:
        max_bytes = parse_max(args.size if args.size is not None else args.max,
                              "MAX" if args.size is not None else "--max")
    return limit(args.name, max_bytes, parse_limit(args.min, "--min"), args.gpu)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvelastic`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so a reader that went away is noticed before the interpreter exits
        return code
    except BrokenPipeError:
        # The reader (head, a pager) stopped reading: end quietly, and keep the exit flush from failing too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _main(argv: list[str]) -> int:
    if argv[:1] == ["launch"]:  # its own parser: option groups separated by --and, vllm arguments after --
        from kvelastic.launcher.command import main as launch

        return launch(argv[1:])
    refused = negative_size(argv)
    if refused is not None:
        print(str(refused), file=sys.stderr)
        return refused.code
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except CliError as error:
        print(str(error), file=sys.stderr)
        return error.code
    except (ConfigError, ClusterError, SharedFileError) as error:
        print(f"kvelastic {args.command}: {printable(str(error))}", file=sys.stderr)
        return next(code for kinds, code in _EXIT_CODES if isinstance(error, kinds))


if __name__ == "__main__":
    sys.exit(main())
