"""Starting the real service for HTTP tests: Ray, Ray Serve and the app with small CPU settings.

The module-scoped fixtures of the HTTP test modules run the service the way `serve run` does
(serve_app.app.build_app) with only what they need changed. The code is the bench kit's
(bench/kit/service.py), which the CPU benches start the service with too.
"""

from __future__ import annotations

import requests

from bench.kit.service import running_service, small_service_args


def user_keys(service: str, admin_key: str, users: tuple[str, ...]) -> dict[str, str]:
    """A key of one user for each of `users`, made through the admin route (POST /v1/admin/keys)."""
    made = {}
    for user in users:
        response = requests.post(f"{service}/v1/admin/keys", json={"users": [user]}, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
        assert response.status_code == 200, response.text
        made[user] = response.json()["key"]
    return made


__all__ = ["running_service", "small_service_args", "user_keys"]
