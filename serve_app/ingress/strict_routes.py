"""How the HTTP routes are registered: strict query parameters, no redirects, both slash forms.

- `StrictQueryRoute`: FastAPI ignores query parameters a route does not declare, although the
  bodies refuse unknown fields (`extra="forbid"`); a `?delete_linked=true`, `?api_key=` or a misspelt
  `user_id` was silently dropped. Each route now refuses a parameter it does not declare (400,
  `code: unsupported_parameter`, `param` its name) and one given twice (400, `code:
  repeated_parameter`: which of the two was meant is not guessed), before its body is parsed.
- `register`: a route answers at its path with and without a trailing slash (the twin left out of
  the schema), so the app never redirects (Starlette's redirect built its `Location` from the
  request's Host header) and `redirect_slashes` is off: any other path is a 404 `route_not_found`
  (serve_app.ingress.errors).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

EndpointT = TypeVar("EndpointT", bound=Callable[..., Any])
Verb = Literal["GET", "POST", "PUT", "DELETE"]


class StrictQueryRoute(APIRoute):
    """An APIRoute that refuses undeclared and repeated query parameters (module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        declared = frozenset(param.alias for param in get_flat_dependant(self.dependant).query_params)

        async def strict(request: Request) -> Any:
            errors: list[dict[str, Any]] = []
            for name in dict.fromkeys(request.query_params.keys()):
                if name not in declared:
                    errors.append({"type": "extra_forbidden", "loc": ("query", name), "msg": "Extra inputs are not permitted", "input": None})
                elif (count := len(request.query_params.getlist(name))) > 1:
                    errors.append({"type": "repeated_parameter", "loc": ("query", name), "msg": f"given {count} times; give it once", "input": None})
            if errors:
                raise RequestValidationError(errors)
            return await handler(request)

        return strict


def strict_app(**kwargs: Any) -> FastAPI:
    """A FastAPI app whose routes are StrictQueryRoutes and which never redirects a slash."""
    app = FastAPI(**kwargs)
    app.router.route_class = StrictQueryRoute
    app.router.redirect_slashes = False
    return app


def register(app: FastAPI, verb: Verb, path: str, **options: Any) -> Callable[[EndpointT], EndpointT]:
    """Registers an endpoint at `path` and at its twin with or without the trailing slash (the twin
    left out of the schema): Mem0's clients end every path with a slash, OpenAI's never do."""
    twin = path.rstrip("/") if path.endswith("/") else f"{path}/"

    def add(endpoint: EndpointT) -> EndpointT:
        app.add_api_route(path, endpoint, methods=[verb], **options)
        app.add_api_route(twin, endpoint, methods=[verb], include_in_schema=False, **options)
        return endpoint

    return add
