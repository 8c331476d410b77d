"""The ``kvelastic`` command: see and steer the kvelastic instances sharing a GPU.

``kvelastic status`` lists every live instance of every GPU account in the
shared directory (``/dev/shm``, or ``$KVELASTIC_SHARED_DIR``); ``kvelastic
limit`` changes an instance's cap or reservation in the account file, which
the instance re-reads on its next upkeep tick (a few times a second);
``kvelastic budget`` shows or changes a GPU's shared budget. Nothing
here imports torch or vLLM, so the command answers instantly.

Exit codes: 0 ok; 2 bad usage or a bad size; 3 unknown instance name; 4 no
account or no live instance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from kvelastic.cluster import (AccountNotFound, BadLimits, ClusterError, MemberInfo, SharedAccount,
                               account_path, find_account_paths, shared_dir)
from kvelastic.errors import ConfigError
from kvelastic.units import SIZE_FORM, format_size, parse_size

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNKNOWN = 3
EXIT_NONE = 4
_CLEAR_WORDS = {"none", "off", "unlimited"}


class CliError(Exception):
    """A failure the CLI reports on stderr and turns into an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvelastic", description="Inspect and steer kvelastic instances "
                                     "sharing GPUs (accounts in $KVELASTIC_SHARED_DIR or /dev/shm).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    status = sub.add_parser("status", help="list live instances and their KV memory")
    status.add_argument("--gpu", metavar="ID", help="only this GPU's account (default: every account found)")
    status.add_argument("--json", action="store_true", help="machine-readable output (bytes as integers)")
    status.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    limit = sub.add_parser("limit", help="change an instance's cap (max) and/or reservation (min)",
                           description="Sizes: " + SIZE_FORM + "; 'none' clears a max or a min.")
    limit.add_argument("name", metavar="NAME", help="instance name (KVELASTIC_NAME)")
    limit.add_argument("size", nargs="?", metavar="MAX", help="new cap, same as --max")
    limit.add_argument("--max", dest="max", metavar="SIZE", help="new cap, or 'none' to remove it")
    limit.add_argument("--min", dest="min", metavar="SIZE", help="new reservation, or 'none' for 0")
    limit.add_argument("--gpu", metavar="ID", help="only this GPU's account (default: every account "
                       "that has NAME; an instance spread over several GPUs gets the limit on each)")
    budget = sub.add_parser("budget", help="show or change a GPU's shared KV budget",
                            description="Sizes: " + SIZE_FORM + ".")
    budget.add_argument("size", nargs="?", metavar="SIZE", help="new budget (omit to show)")
    budget.add_argument("--gpu", metavar="ID", help="the GPU's account (needed to change it when "
                        "there are several)")
    return parser


def parse_limit(text: str | None, argument: str) -> int | None:
    """Bytes from a size argument; 'none' is 0; None stays None. CliError(2) on garbage."""
    if text is None:
        return None
    if text.strip().lower() in _CLEAR_WORDS:
        return 0
    try:
        return parse_size(text, name=argument)
    except ConfigError as error:
        raise CliError(f"kvelastic limit: {error}; or 'none'", EXIT_USAGE) from None


# ------------------------------------------------------------------ accounts
def open_accounts(gpu: str | None) -> list[SharedAccount]:
    """The account of ``gpu``, or every account in the shared directory; CliError(4) if none."""
    where = shared_dir()
    paths = [account_path(gpu)] if gpu else find_account_paths()
    accounts = []
    for path in paths:
        try:
            accounts.append(SharedAccount.attach(path))
        except AccountNotFound:
            continue
        except ClusterError as error:
            print(f"kvelastic: skipping {path}: {error}", file=sys.stderr)
    if not accounts:
        what = f"for GPU {gpu!r}" if gpu else "of any GPU"
        raise CliError(f"kvelastic: no account {what} in {where} (is a kvelastic instance running? "
                       f"KVELASTIC_SHARED_DIR sets the directory)", EXIT_NONE)
    return accounts


def snapshot(accounts: list[SharedAccount]) -> list[dict]:
    """One JSON-ready dict per account: GPU, budget, usage and live members."""
    result = []
    for account in accounts:
        members = account.members()
        charged = sum(m.charged_bytes for m in members)
        result.append({"gpu": account.gpu_id, "path": str(account.path), "budget_bytes": account.budget,
                       "charged_bytes": charged, "mapped_bytes": sum(m.mapped_bytes for m in members),
                       "members": [m.as_dict() for m in members]})
    return result


# -------------------------------------------------------------------- status
_COLUMNS = ("INSTANCE", "PID", "MODEL", "PORT", "MAPPED", "CACHED", "HOST", "MIN", "MAX", "WANTED", "SEEN")


def _short(text: str, width: int = 32) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _row(m: MemberInfo, now: float) -> tuple[str, ...]:
    size = format_size
    return (m.name, str(m.pid), _short(m.model) or "-", str(m.port) if m.port else "-",
            size(m.mapped_bytes), size(m.cached_bytes), size(m.host_bytes),
            size(m.min_bytes) if m.min_bytes else "-", size(m.max_bytes) if m.max_bytes else "none",
            size(m.wanted_bytes) if m.wanted_bytes else "-", f"{max(0.0, now - m.heartbeat):.0f}s ago")


def render_table(accounts: list[dict], now: float | None = None) -> str:
    """The human status text: a heading per GPU, then an aligned row per instance."""
    now = time.time() if now is None else now
    lines = []
    for acct in accounts:
        budget, charged = acct["budget_bytes"], acct["charged_bytes"]
        share = 100.0 * charged / budget if budget else 0.0
        lines.append(f"GPU {acct['gpu']}: budget {format_size(budget)}, in use or reserved "
                     f"{format_size(charged)} ({share:.0f}%), free {format_size(max(0, budget - charged))}")
        rows = [_row(MemberInfo(**m), now) for m in acct["members"]]
        if not rows:
            lines.append("  (no live instances)")
            continue
        widths = [max(len(r[i]) for r in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]
        for row in [_COLUMNS, *rows]:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def status_once(gpu: str | None, as_json: bool) -> int:
    accounts = open_accounts(gpu)
    try:
        data = snapshot(accounts)
    finally:
        for account in accounts:
            account.close()
    print(json.dumps({"accounts": data}, indent=2) if as_json else render_table(data))
    if not any(acct["members"] for acct in data):
        print("kvelastic: no live kvelastic instances", file=sys.stderr)
        return EXIT_NONE
    return EXIT_OK


def status_watch(gpu: str | None, as_json: bool, seconds: float) -> int:
    """Redraw the status every ``seconds`` until Ctrl-C; missing accounts are shown, not fatal."""
    if seconds <= 0:
        raise CliError(f"kvelastic status: --watch={seconds:g} must be a positive number of seconds", EXIT_USAGE)
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
    if max_bytes is None and min_bytes is None:
        raise CliError("kvelastic limit: give a new MAX (or --max SIZE|none) and/or --min SIZE|none", EXIT_USAGE)
    accounts = open_accounts(gpu)
    changed, live = [], set()
    try:
        for account in accounts:
            names = {m.name for m in account.members()}
            live |= names
            if name in names:
                try:
                    changed.append((account.gpu_id, account.set_limits(name, min_bytes=min_bytes,
                                                                       max_bytes=max_bytes)))
                except BadLimits as error:
                    raise CliError(f"kvelastic limit: {error}", EXIT_USAGE) from None
    finally:
        for account in accounts:
            account.close()
    if not changed:
        known = ", ".join(sorted(live)) or "none"
        raise CliError(f"kvelastic limit: no live instance called {name!r} (live instances: {known})",
                       EXIT_UNKNOWN)
    for gpu_id, info in changed:
        cap = format_size(info.max_bytes) if info.max_bytes else "none"
        print(f"{name} on GPU {gpu_id}: max {cap}, min {format_size(info.min_bytes)} "
              f"(holds {format_size(info.mapped_bytes)})")
    return EXIT_OK


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
            print(f"GPU {account.gpu_id}: budget {format_size(account.budget)}")
    finally:
        for account in accounts:
            account.close()
    return EXIT_OK


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    if args.command == "status":
        if args.watch is not None:
            return status_watch(args.gpu, args.json, args.watch)
        return status_once(args.gpu, args.json)
    if args.command == "budget":
        return budget(args.size, args.gpu)
    if args.size is not None and args.max is not None:
        raise CliError("kvelastic limit: give the new max either as MAX or as --max, not both", EXIT_USAGE)
    max_bytes = parse_limit(args.size if args.size is not None else args.max,
                            "MAX" if args.size is not None else "--max")
    return limit(args.name, max_bytes, parse_limit(args.min, "--min"), args.gpu)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvelastic`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except CliError as error:
        print(str(error), file=sys.stderr)
        return error.code
    except ClusterError as error:
        print(f"kvelastic: {error}", file=sys.stderr)
        return EXIT_NONE


if __name__ == "__main__":
    sys.exit(main())
