"""``flexorch dashboard``: the plan viewer of a run directory, or of a run's records in its checkpoint storage."""

from __future__ import annotations

import argparse
import hashlib
import threading
from pathlib import Path

__all__ = ["add_dashboard_parser", "cmd_dashboard"]


def add_dashboard_parser(sub) -> None:
    dash = sub.add_parser("dashboard", help="serve the plan viewer page for a run directory (live while it runs)")
    dash.add_argument(
        "run_dir",
        help="run directory of `flexorch train` or `flexorch plan --run-dir`, or a run's [checkpoint] storage "
        "(s3://..., gs://...): the records its checkpoints copied there",
    )
    dash.add_argument(
        "--refresh", type=float, default=30.0, help="seconds between copies of a storage's records (default 30)"
    )
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    dash.add_argument("--port", type=int, default=8266, help="port (default 8266; 0 picks a free one)")
    dash.add_argument("--poll", type=float, default=2.0, help="seconds between the page's refreshes (default 2)")


def cmd_dashboard(args: argparse.Namespace) -> int:
    from flexorch.dashboards.viewer import ViewerServer

    stop = threading.Event()
    run_dir, what = _dashboard_source(args, stop)
    try:
        server = ViewerServer(run_dir, host=args.host, port=args.port, poll_s=args.poll)
        print(f"flexorch dashboard: serving {what} at {server.url} (Ctrl-C to stop)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    finally:
        stop.set()
    return 0


def _dashboard_source(args: argparse.Namespace, stop: threading.Event) -> tuple[Path, str]:
    """The local directory the dashboard serves, and what to call it: a run directory as it is; a checkpoint
    storage's records copied into a local cache, then copied again every ``--refresh`` seconds by a thread (they
    change at each checkpoint) until ``stop`` is set."""
    from flexorch.data.store.remote import is_remote

    if not is_remote(args.run_dir):
        return Path(args.run_dir), args.run_dir
    from flexorch.control.run_checkpoints import fetch_records

    key = hashlib.sha256(args.run_dir.encode()).hexdigest()[:16]
    local = Path.home() / ".cache" / "flexorch" / "stored-runs" / key
    fetch_records(args.run_dir, local)

    def refresh() -> None:
        while not stop.wait(args.refresh):
            try:
                fetch_records(args.run_dir, local)
            except Exception as e:  # noqa: BLE001 - the page keeps the last copy; said once per failure
                print(f"flexorch dashboard: could not copy {args.run_dir}/run again ({e}); showing the last copy")

    threading.Thread(target=refresh, name="flexorch-dashboard-refresh", daemon=True).start()
    return local, f"{args.run_dir}/run (copied to {local}, again every {args.refresh:g} s)"
