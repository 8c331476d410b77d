"""``kvelastic top``: a live view of every instance's KV memory, and how it moved lately.

Each refresh reads the same accounts as ``kvelastic status`` and keeps, per
instance, its recent ``MAPPED`` readings; the last column draws them as a
sparkline (HISTORY, newest on the right) on the scale of the GPU's budget, so
instances on one GPU compare at a glance and a full bar means the instance
holds the whole budget. Drawn
with ``rich`` (a vLLM dependency, and one of kvelastic's).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from typing import Any, Iterable

from kvelastic.units import format_size

BARS = " ▁▂▃▄▅▆▇█"
HISTORY = 40  # readings kept per instance: the sparkline's width


class History:
    """Recent ``MAPPED`` readings per (GPU, instance); instances that left are forgotten."""

    def __init__(self, length: int = HISTORY):
        self.length = length
        self.readings: dict[tuple[str, str], deque[int]] = {}

    def add(self, accounts: list[dict]) -> None:
        seen = set()
        for account in accounts:
            for member in account["members"]:
                key = (account["gpu"], member["name"])
                seen.add(key)
                self.readings.setdefault(key, deque(maxlen=self.length)).append(int(member["mapped_bytes"]))
        for key in set(self.readings) - seen:
            del self.readings[key]

    def of(self, gpu: str, name: str) -> Iterable[int]:
        return self.readings.get((gpu, name), ())


def sparkline(values: Iterable[int], scale: int) -> str:
    """One character per reading: its share of ``scale`` in eighths (empty: nothing mapped)."""
    top = len(BARS) - 1
    return "".join(BARS[min(top, -(-value * top // scale))] if scale > 0 else BARS[0] for value in values)


def render(accounts: list[dict], history: History, now: float | None = None) -> Any:
    """The rich renderable of one refresh: a table per GPU."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from kvelastic.status_view import member_of, member_row
    from kvelastic.shared.text import printable

    now = time.time() if now is None else now
    tables = []
    for account in accounts:
        budget, charged = account["budget_bytes"], account["charged_bytes"]
        share = 100.0 * charged / budget if budget else 0.0
        gpu = escape(printable(account["gpu"]))  # read from a shared file: never terminal codes or markup
        table = Table(title=f"GPU {gpu}: budget {format_size(budget)}, in use or reserved "
                            f"{format_size(charged)} ({share:.0f}%)", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("INSTANCE", "MAPPED", "CACHED", "HOST", "MIN", "MAX"):
            table.add_column(column, justify="left" if column == "INSTANCE" else "right", no_wrap=True)
        table.add_column("HISTORY", no_wrap=True, max_width=history.length, overflow="crop")
        for data in account["members"]:
            name, _, _, _, mapped, cached, host, low, high, _, _ = member_row(member_of(data), now)
            table.add_row(escape(name), mapped, cached, host, low, high,  # a name is text, never rich markup
                          sparkline(history.of(account["gpu"], name), budget))
        if not account["members"]:
            table.add_row("(no live instances)", *[""] * 6)
        tables.append(table)
    return Group(*tables)


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The ``top`` subcommand of the ``kvelastic`` parser."""
    parser = sub.add_parser("top", help="live view: each instance's KV memory and its recent history")
    parser.add_argument("--gpu", metavar="ID", help="only this GPU's account (as for status)")
    parser.add_argument("--interval", type=_seconds, default=2.0, metavar="SECONDS",
                        help="refresh period (default 2)")
    parser.add_argument("--count", type=_positive_int, metavar="N",
                        help="stop after N refreshes (default: until Ctrl-C); the exit status is then the "
                             "last refresh's, as `kvelastic status` gives it")


def _seconds(text: str) -> float:
    from kvelastic.cli_input import seconds_argument

    return seconds_argument(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def main(args: argparse.Namespace) -> int:
    """``kvelastic top`` with parsed arguments."""
    return run(args.gpu, args.interval, args.count)


def frame(gpu: str | None, history: History) -> tuple[Any, int]:
    """One refresh: the view, and the exit status ``kvelastic status`` would give (0, 4 none, 6 unreadable).

    Bad usage (a ``--gpu`` that names nothing) is raised: no later refresh could change it.
    """
    from rich.console import Group
    from rich.text import Text

    from kvelastic.cli import EXIT_CORRUPT, EXIT_NONE, EXIT_OK, EXIT_USAGE, CliError, read_accounts
    from kvelastic.shared.text import printable

    broken: list[dict] = []
    try:
        data = read_accounts(gpu, broken)
    except CliError as error:
        if error.code == EXIT_USAGE:
            raise
        return Text(str(error)), error.code
    history.add(data)
    lines = [Text(f"GPU {printable(b['gpu'])}: cannot read its account: {b['error']}") for b in broken]
    code = EXIT_CORRUPT if broken else EXIT_OK if any(a["members"] for a in data) else EXIT_NONE
    return Group(render(data, history), *lines), code


def run(gpu: str | None, interval: float, count: int | None) -> int:
    """Redraw every ``interval`` seconds until Ctrl-C (or ``count`` refreshes); missing accounts are shown.

    On a terminal each refresh replaces the last; otherwise (a pipe, a log
    file) each is printed whole as it comes, ending with a newline. Stopped
    after ``count`` refreshes, the exit status is the last one's, as
    ``kvelastic status`` would give it; stopped with Ctrl-C, 0.
    """
    from rich.console import Console

    console = Console()
    history = History()
    code = 0
    try:
        if console.is_terminal:
            code = _live(console, gpu, history, interval, count)
        else:
            for done in range(1, count + 1) if count is not None else itertools.count(1):
                view, code = frame(gpu, history)
                console.print(view)
                console.file.flush()
                if count is None or done < count:
                    time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    return code


def _live(console: Any, gpu: str | None, history: History, interval: float, count: int | None) -> int:
    """The refreshes on a terminal: each replaces the last in place; the exit status of the last one."""
    from rich.live import Live
    from rich.text import Text

    code, done = 0, 0
    with Live(Text("reading accounts..."), console=console, auto_refresh=False) as live:
        while count is None or done < count:
            view, code = frame(gpu, history)
            live.update(view, refresh=True)
            done += 1
            if count is None or done < count:
                time.sleep(interval)
    return code
