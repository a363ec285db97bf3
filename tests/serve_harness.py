"""Starting the real service for HTTP tests: Ray, Ray Serve and the app with small CPU settings.

The module-scoped fixtures of the HTTP test modules run the service the way `serve run` does
(serve_app.app.build_app) with only what they need changed. The code is the bench kit's
(bench/kit/service.py), which the CPU benches start the service with too.
"""

from __future__ import annotations

from bench.kit.service import running_service, small_service_args

__all__ = ["running_service", "small_service_args"]
