"""The Mem0 platform routes this service does not implement yet: each answers 501 naming the client
method(s) that call it and the route, instead of the 404 an unknown route gets (which `mem0ai` raises
as MemoryNotFoundError, "memory not found": misleading). `mem0ai` raises a 501 as its plain
MemoryError, whose message is the body (`detail` holds the message for Mem0's clients; `error` is
the OpenAI-shaped body every error of this service has, `code: not_implemented`).

The routes are the ones `mem0ai` 2.2.1's MemoryClient, AsyncMemoryClient and `client.project` call
(tests/test_mem0_client.py lists the installed client's methods by introspection and checks each
either works or gets this 501). They need a valid key like every route (serve_app.ingress.gate),
touch nothing, accept any query parameters (the client sends org_id and project_id on some) and are
left out of the OpenAPI schema: the schema documents what the service implements.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from serve_app.ingress.errors import error_type
from serve_app.ingress.routes import api
from serve_app.protocol import ErrorBody, ErrorResponse

PROJECT = "/api/v1/orgs/organizations/{org_id}/projects/{project_id}/"

# (verb, path, the client methods that call it); MemoryClient's and AsyncMemoryClient's share their names
NOT_IMPLEMENTED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("GET", "/v1/entities/", ("users", "delete_users", "reset")),  # delete_users() and reset() list the users first
    ("DELETE", "/v2/entities/{entity_type}/{entity_id}/", ("delete_users",)),
    ("PUT", "/v1/batch/", ("batch_update",)),
    ("DELETE", "/v1/batch/", ("batch_delete",)),
    ("POST", "/v1/exports/", ("create_memory_export",)),
    ("POST", "/v1/exports/get/", ("get_memory_export",)),
    ("POST", "/v1/summary/", ("get_summary",)),
    ("POST", "/v1/feedback/", ("feedback",)),
    ("GET", "/v2/entities/user/{entity_id}/profile/", ("get_profile",)),
    ("POST", "/v2/profiles/jobs/", ("generate_profile", "sample_profiles")),
    ("GET", "/v2/profiles/jobs/{job_id}/", ("get_profile_job",)),
    ("GET", "/v2/profiles/settings/", ("get_profile_settings",)),
    ("POST", "/v2/profiles/settings/", ("update_profile_settings",)),
    ("GET", PROJECT, ("get_project", "project.get")),
    ("PATCH", PROJECT, ("update_project", "project.update")),
    ("DELETE", PROJECT, ("project.delete",)),
    ("POST", "/api/v1/orgs/organizations/{org_id}/projects/", ("project.create",)),
    ("GET", PROJECT + "members/", ("project.get_members",)),
    ("POST", PROJECT + "members/", ("project.add_member",)),
    ("PUT", PROJECT + "members/", ("project.update_member",)),
    ("DELETE", PROJECT + "members/", ("project.remove_member",)),
)


def not_implemented_answer(verb: str, path: str, methods: tuple[str, ...]) -> JSONResponse:
    """The 501 for a route (module docstring): the OpenAI-shaped `error`, and Mem0's `detail`."""
    named = ", ".join(f"MemoryClient.{method}" for method in methods)
    message = f"{verb} {path} ({named}, and AsyncMemoryClient's of the same name) is not implemented by this service"
    body = ErrorResponse(error=ErrorBody(message=message, type=error_type(501), code="not_implemented"))
    return JSONResponse({**body.model_dump(), "detail": message}, status_code=501)


def _endpoint(verb: str, path: str, methods: tuple[str, ...]) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def not_implemented(request: Request) -> JSONResponse:
        return not_implemented_answer(verb, path, methods)

    not_implemented.__name__ = f"mem0_{methods[0].replace('.', '_')}_not_implemented"
    return not_implemented


for _verb, _path, _methods in NOT_IMPLEMENTED:
    for _form in (_path, _path.rstrip("/")):  # both slash forms, as every Mem0 route here (serve_app.ingress.strict_routes)
        api.router.add_api_route(_form, _endpoint(_verb, _path, _methods), methods=[_verb], include_in_schema=False, route_class_override=APIRoute)
