"""What ``kvelastic status --json`` samples saw: per GPU account, the most each member mapped.

    python3 benchmarks/accounts_seen.py DIR     # DIR holds status-*.json, one sample each

Prints one line per account and member and writes DIR/accounts_seen.json. Exit 0 if at least
``--expect`` accounts had a member that mapped KV memory, else 1. ``gpu_session.sh tp-accounts``
samples while a TP=2 engine serves: an engine over two GPUs must be a member of both accounts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--expect", type=int, default=2, help="accounts that must show a member mapping memory")
    args = p.parse_args(argv)
    seen: dict[str, dict[str, int]] = {}
    samples = 0
    for path in sorted(Path(args.dir).glob("status-*.json")):
        try:
            accounts = json.loads(path.read_text()).get("accounts", [])
        except (ValueError, OSError):
            continue  # a sample cut short
        samples += 1
        for account in accounts:
            members = seen.setdefault(account["gpu"], {})
            for member in account.get("members", []):
                members[member["name"]] = max(members.get(member["name"], 0), int(member["mapped_bytes"]))
    for gpu, members in seen.items():
        for name, most in members.items():
            print(f"{gpu}  {name}: mapped at most {most / 2**30:.2f} GiB")
    mapping = sum(any(most > 0 for most in members.values()) for members in seen.values())
    Path(args.dir, "accounts_seen.json").write_text(json.dumps({"samples": samples, "accounts": seen}, indent=1))
    print(f"{samples} samples; {mapping} account(s) with a member that mapped KV memory (expected {args.expect})")
    return 0 if mapping >= args.expect else 1


if __name__ == "__main__":
    raise SystemExit(main())
