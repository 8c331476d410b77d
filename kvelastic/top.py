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
    parser.add_argument("--interval", type=_positive(float), default=2.0, metavar="SECONDS",
                        help="refresh period (default 2)")
    parser.add_argument("--count", type=_positive(int), metavar="N",
                        help="stop after N refreshes (default: until Ctrl-C)")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
        return value

    return parse


def main(args: argparse.Namespace) -> int:
    """``kvelastic top`` with parsed arguments."""
    return run(args.gpu, args.interval, args.count)


def run(gpu: str | None, interval: float, count: int | None) -> int:
    """Redraw every ``interval`` seconds until Ctrl-C (or ``count`` refreshes); missing accounts are shown."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from kvelastic.cli import CliError, read_accounts

    history = History()
    console = Console()
    done = 0
    try:
        with Live(Text("reading accounts..."), console=console, auto_refresh=False) as live:
            while count is None or done < count:
                try:
                    data = read_accounts(gpu)
                    history.add(data)
                    view = render(data, history)
                except CliError as error:
                    view = Text(str(error))
                live.update(view, refresh=True)
                done += 1
                if count is None or done < count:
                    time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
