"""Say when a `serve run` application answers, or why it never will: polls /health and Serve's status.

`serve run config.yaml` only prints that it submitted the config; the engine then takes a minute
or more to start. `make serve` runs this beside it, so the terminal says when the README's curl
examples will work:

    python -m devtools.announce_ready --config config.yaml [--timeout-s 1800] [--serve-pid PID]

A start that cannot succeed (a memory plan that does not fit the card, an engine that cannot get its
memory: the builder or the replica raises) leaves `serve run` running with the application
DEPLOY_FAILED (Ray Serve retries a failing replica constructor 3 times for one replica, then stops).
This reads Serve's status from the Ray dashboard (what `serve status` reads: RAY_DASHBOARD_ADDRESS,
default http://127.0.0.1:8265, with Ray's token from RAY_AUTH_TOKEN or ~/.ray/auth_token when Ray
asks for one), prints the failure's message, stops `serve run` (SIGINT to --serve-pid, its own
Ctrl-C shutdown) and exits 2. It exits 1 when `serve run` ended first or nothing answered in time.

Standard library and PyYAML only: it runs before anything else is known to work.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

FAILED = "DEPLOY_FAILED"


def health_url(config: Path) -> str:
    """The /health address of the config's HTTP proxy (a wildcard host is reached on loopback)."""
    options = (yaml.safe_load(config.read_text()) or {}).get("http_options") or {}
    host = options.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{options.get('port', 8000)}/health"


def app_name(config: Path) -> str:
    applications = (yaml.safe_load(config.read_text()) or {}).get("applications") or [{}]
    return applications[0].get("name", "default")


def healthy(url: str) -> dict | None:
    """The health report when it says ok, else None (not listening yet, or 503 while a part starts)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            report = json.loads(response.read())
            return report if report.get("status") == "ok" else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_until_healthy(url: str, timeout_s: float, poll_s: float = 1.0) -> dict | None:
    """The health report once it says ok, or None when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = healthy(url)
        if report is not None:
            return report
        time.sleep(poll_s)
    return None


def ray_token() -> str | None:
    """Ray's auth token as Ray's own clients find it (environment, then its file), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def deploy_failure(dashboard: str, app: str) -> str | None:
    """Serve's message when application `app` is DEPLOY_FAILED, else None (running, deploying, or
    the dashboard not answering yet)."""
    request = urllib.request.Request(f"{dashboard.rstrip('/')}/api/serve/applications/")
    token = ray_token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            details = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    status = ((details.get("applications") or {}).get(app)) or {}
    if status.get("status") != FAILED:
        return None
    failed = [f"{name}: {d.get('message', '')}" for name, d in (status.get("deployments") or {}).items() if d.get("status") == FAILED]
    return "\n".join([status.get("message") or "", *failed]).strip() or FAILED


def alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--serve-pid", type=int, default=None, help="`serve run`'s process: stopped when the app failed to deploy")
    parser.add_argument("--dashboard", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"))
    parser.add_argument("--poll-s", type=float, default=1.0)
    args = parser.parse_args()
    url, app = health_url(args.config), app_name(args.config)
    started = time.monotonic()
    while time.monotonic() - started < args.timeout_s:
        report = healthy(url)
        if report is not None:
            base = url.rsplit("/health", 1)[0]
            print(f"kvmem: application running at {base} ({time.monotonic() - started:.0f} s; /health: {json.dumps(report)})", flush=True)
            return
        failure = deploy_failure(args.dashboard, app)
        if failure is not None:
            print(f"kvmem: the application failed to deploy ({time.monotonic() - started:.0f} s); stopping serve run. "
                  f"Serve's status:\n{failure}", file=sys.stderr, flush=True)
            if args.serve_pid is not None and alive(args.serve_pid):
                os.kill(args.serve_pid, signal.SIGINT)
            sys.exit(2)
        if not alive(args.serve_pid):
            print("kvmem: serve run ended before the application answered; see the log above", file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(args.poll_s)
    print(f"kvmem: no healthy answer from {url} after {args.timeout_s:.0f} s; see the log above", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
