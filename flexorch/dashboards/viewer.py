"""The plan viewer: a small web page that shows a run's step records live (`flexorch dashboard RUN_DIR`).

A standard-library HTTP server (one thread per request) bound to 127.0.0.1 by default serves:

* ``/`` the page (``dashboards/static/index.html`` + ``viewer.js``), drawn with Plotly.js;
* ``/plotly.min.js`` the Plotly.js bundle that ships inside the ``plotly`` Python package (no CDN, works offline);
* ``/api/steps?since=N`` the records from the N-th on, as :func:`flexorch.dashboards.viewer_data.read_run` returns them
  (the page polls it every ``poll_s`` seconds, so a running job's new steps appear as they are written).

The page shows the selected step as devices x time (one bar per SP group: degree, method, sequences; predicted
from the cost model and, for trained steps, measured), its solve time and the baselines' predicted step times,
a chart of predicted vs measured step time over the run, and a table of all steps. Each recovery (a record's
``recoveries``) is shown in its step's row and in a list of the run's recoveries above the table (hidden when there
is none): the workers lost or joined, what was done, and the time it cost in the CLI's words (``recovered in 12.0 s:
detect 10.1 s, re-form 0.4 s, re-run 1.5 s``, detected by heartbeat or Ray), a grow's admission time, a roll-back's
steps. A malformed record is shown as an error banner naming the line, above the steps read before it.

A step of several ``[[tasks]]`` (its record has ``tasks``) colours each SP group by the task it ran instead of by
degree (the legend: each task's name and loss this step; the colours are ``plan_svg.task_colour``'s, as in the SVG
pictures); a panel above the pictures says how the tasks were placed (``multitask``: Spindle or in turn, Spindle's
bound, makespan and gap, the plan's simulated and dataflow times) and each task's ranks, documents, tokens, loss
targets and loss, and the step table gets a column of the same per step. Records without tasks get neither.

A device slower than 0.8x the others (``viewer_data.rank_speeds``: the worker's measured speed in a trained record,
else the speed its plan was priced with) has its row shaded in the pictures, its speed at their right (hover: which
ranks, how slow), and the step summary names it; a group's hover gives the pace it ran at (its slowest member's).
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from flexorch.dashboards.viewer_data import read_run

__all__ = ["ViewerServer", "plotly_js_path"]

STATIC = Path(__file__).resolve().parent / "static"
_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/viewer.js": ("viewer.js", "text/javascript")}


def plotly_js_path() -> Path:
    """The Plotly.js bundle of the installed ``plotly`` package (a dependency of flexorch)."""
    try:
        import plotly
    except ImportError:
        raise RuntimeError("the plan viewer needs the 'plotly' package: pip install plotly") from None
    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"the plotly package has no {path.name} at {path}; reinstall it: pip install -U plotly")
    return path


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # quiet: the page polls every few seconds

    def _send(self, body: bytes, ctype: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        try:
            if url.path == "/api/steps":
                since = int(parse_qs(url.query).get("since", ["0"])[0])
                data = read_run(self.server.run_dir, since=max(since, 0))
                data["run"] = str(self.server.run_dir)
                data["poll_s"] = self.server.poll_s
                self._send(json.dumps(data).encode(), "application/json")
            elif url.path == "/plotly.min.js":
                self._send(self.server.plotly_js, "text/javascript")
            elif url.path == "/favicon.ico":
                self._send(b"", "image/x-icon", HTTPStatus.NO_CONTENT)
            elif url.path in _FILES:
                name, ctype = _FILES[url.path]
                self._send((STATIC / name).read_bytes(), ctype)
            else:
                self._send(b"not found", "text/plain", HTTPStatus.NOT_FOUND)
        except ValueError as e:
            self._send(json.dumps({"error": f"bad request: {e}"}).encode(), "application/json", HTTPStatus.BAD_REQUEST)
        except OSError as e:
            msg = {"error": f"cannot read the run: {e}", "records": [], "total": 0}
            self._send(json.dumps(msg).encode(), "application/json", HTTPStatus.INTERNAL_SERVER_ERROR)


class ViewerServer(ThreadingHTTPServer):
    """Serves one run directory. ``port=0`` picks a free port (see :attr:`url`)."""

    daemon_threads = True

    def __init__(self, run_dir: Path | str, host: str = "127.0.0.1", port: int = 8266, poll_s: float = 2.0):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(
                f"run directory {self.run_dir} does not exist: pass the run_dir of a `flexorch train` run or the "
                "--run-dir of a `flexorch plan` run"
            )
        self.poll_s = poll_s
        self.plotly_js = plotly_js_path().read_bytes()
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another with --port") from None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> ViewerServer:
        """Serve in a background thread (for `flexorch train --dashboard` and tests)."""
        self._thread = threading.Thread(target=self.serve_forever, name="flexorch-viewer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
