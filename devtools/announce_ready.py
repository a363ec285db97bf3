"""Say when a `serve run` application answers: polls its /health and prints one line.

`serve run config.yaml` only prints that it submitted the config; the engine then takes a minute
or more to start. `make serve` runs this beside it, so the terminal says when the README's curl
examples will work:

    python -m devtools.announce_ready --config config.yaml [--timeout-s 1800]

Standard library and PyYAML only: it runs before anything else is known to work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml


def health_url(config: Path) -> str:
    """The /health address of the config's HTTP proxy (a wildcard host is reached on loopback)."""
    options = (yaml.safe_load(config.read_text()) or {}).get("http_options") or {}
    host = options.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{options.get('port', 8000)}/health"


def wait_until_healthy(url: str, timeout_s: float, poll_s: float = 1.0) -> dict | None:
    """The health report once it says ok, or None when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                report = json.loads(response.read())
                if report.get("status") == "ok":
                    return report
        except (urllib.error.URLError, OSError, ValueError):
            pass  # not listening yet, or 503 while a part starts
        time.sleep(poll_s)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    url = health_url(args.config)
    started = time.monotonic()
    report = wait_until_healthy(url, args.timeout_s)
    if report is None:
        print(f"kvmem: no healthy answer from {url} after {args.timeout_s:.0f} s; see the log above", file=sys.stderr, flush=True)
        sys.exit(1)
    base = url.rsplit("/health", 1)[0]
    print(f"kvmem: application running at {base} ({time.monotonic() - started:.0f} s; /health: {json.dumps(report)})", flush=True)


if __name__ == "__main__":
    main()
