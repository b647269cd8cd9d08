"""``spectune alerts list | ack ID``: the operator's view of the ``alerts`` table.

Reached through ``controller.cli`` (which reads the environment and passes the database URL default in).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from telemetry.alerts import ALERT_KINDS, alert_to_json
from telemetry.alerts_store import AlertStore

LIST_LIMIT = 50  # newest alerts shown by default


def build_parser(db_default: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectune alerts", description="Drift alerts and model updates.")
    sub = ap.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("list", help="the newest alerts, newest first")
    p.add_argument("--all", action="store_true", help="include acked alerts")
    p.add_argument("--kind", choices=ALERT_KINDS, default=None)
    p.add_argument("--limit", type=int, default=LIST_LIMIT)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--db-url", default=db_default)
    p = sub.add_parser("ack", help="acknowledge an alert: the same change is not raised again")
    p.add_argument("id", type=int)
    p.add_argument("--by", default="operator", help="who acknowledges")
    p.add_argument("--db-url", default=db_default)
    return ap


def main(argv: Sequence[str], db_default: str) -> int:
    """Run ``list`` or ``ack``; project errors propagate to ``controller.cli`` (one ``error:`` line, status 2)."""
    args = build_parser(db_default).parse_args(list(argv))
    with AlertStore(args.db_url) as st:
        if args.action == "ack":
            a = st.ack(args.id, who=args.by)
            print(f"alert {a.id} acked by {a.acked_by}: {a.message}")
            return 0
        for a in st.list_alerts(args.limit, unacked_only=not args.all, kind=args.kind):
            if args.json:
                print(json.dumps(alert_to_json(a), sort_keys=True))
            else:
                state = "acked" if a.acked_at is not None else "open"
                print(f"{a.id:>6}  {state:<5}  {a.kind:<16}  {a.message}")
    return 0
