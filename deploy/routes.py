"""Which requests the HTTP guard forwards to Triton, and as what (pure: method and request target in, a
:class:`Route` or a :class:`RouteError` out).

The rule: **only origin-form targets** (``/v2/...``, RFC 9112 §3.2.1) that spell one of Triton's KServe v2
HTTP endpoints exactly are routed. Refused with 400: absolute-form (``POST http://host/v2/...``: the guard
of before matched paths with a regex anchored at ``/`` and let such a request through unchecked, to crash
Triton), authority- and asterisk-form, query strings and fragments (the API takes none), percent-encoding
(no served name needs it; ``..%2F..%2Ftmp`` reached Triton as a model name), empty or dot segments. A target
of the right form that names no endpoint gets 404, a known endpoint with another method 405. Model names are
:data:`e3.deploy.request_check.MODEL_NAME`, versions decimal, shared-memory region names the same
characters.

Each route carries Triton's API category (the names ``--http-restricted-api`` takes) so that the guard can
ask for the user's API key where Triton would have: see :data:`KEYED`. Not routed (404): ``generate`` and
``generate_stream`` (no model here is served through them, and their bodies are not checked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from e3.deploy.request_check import MODEL_NAME

__all__ = ["Route", "RouteError", "route", "KEYED", "CATEGORIES"]

# Triton 2.51's API categories (tritonserver --help, --http-restricted-api)
CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
# The categories that need the user's key when one is set (`e3 serve` with E3_API_HEADER/E3_API_KEY): what
# changes the server, reads its memory or its configuration.
KEYED = frozenset({"shared-memory", "model-config", "model-repository", "trace", "logging"})
_MAX_TARGET = 1024
_SEGMENT = r"([A-Za-z0-9_][A-Za-z0-9_.\-]{0,199})"
_VERSION = r"(?:/versions/([0-9]{1,18}))?"
_MODEL = rf"/v2/models/{_SEGMENT}{_VERSION}"
_SHM = r"/v2/(?:system|cuda)sharedmemory"

# (pattern, {method: (kind, category)}); kind "infer" and "repository" bodies get their own checks,
# "json" bodies a strict parse and canonical form, "plain" requests have no body.
_ROUTES: list[tuple[re.Pattern, dict[str, tuple[str, str]]]] = [
    (re.compile(r"/v2/health/(?:live|ready)"), {"GET": ("plain", "health")}),
    (re.compile(r"/v2"), {"GET": ("plain", "metadata")}),
    (re.compile(r"/metrics"), {"GET": ("metrics", "")}),
    (re.compile(r"/v2/models/stats"), {"GET": ("plain", "statistics")}),
    (re.compile(_MODEL), {"GET": ("plain", "metadata")}),
    (re.compile(_MODEL + "/ready"), {"GET": ("plain", "health")}),
    (re.compile(_MODEL + "/config"), {"GET": ("plain", "model-config")}),
    (re.compile(_MODEL + "/stats"), {"GET": ("plain", "statistics")}),
    (re.compile(_MODEL + "/infer"), {"POST": ("infer", "inference")}),
    (re.compile(_MODEL + "/trace/setting"), {"GET": ("plain", "trace"), "POST": ("json", "trace")}),
    (re.compile(r"/v2/trace/setting"), {"GET": ("plain", "trace"), "POST": ("json", "trace")}),
    (re.compile(r"/v2/logging"), {"GET": ("plain", "logging"), "POST": ("json", "logging")}),
    (re.compile(r"/v2/repository/index"), {"POST": ("json", "model-repository")}),
    (re.compile(rf"/v2/repository/models/{_SEGMENT}/(?:load|unload)"), {"POST": ("repository", "model-repository")}),
    (re.compile(rf"{_SHM}(?:/region/{_SEGMENT})?/status"), {"GET": ("plain", "shared-memory")}),
    (re.compile(rf"{_SHM}/region/{_SEGMENT}/register"), {"POST": ("json", "shared-memory")}),
    (re.compile(rf"{_SHM}(?:/region/{_SEGMENT})?/unregister"), {"POST": ("json", "shared-memory")}),
]


class RouteError(ValueError):
    """Not routed: ``status`` (400, 404 or 405) and a message naming why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Route:
    kind: str          # "infer", "repository", "json", "plain" or "metrics" (the guard's own page)
    category: str      # Triton's API category ("" for the guard's own pages)
    path: str          # the origin-form path to forward, exactly as checked
    model: str | None  # the model named in the path, if any


@lru_cache(maxsize=4096)
def route(method: str, target: str) -> Route:
    """The route of a request with ``method`` and request-target ``target`` (as on the request line).

    Routes found are cached (at most 4,096 targets of at most 1,024 characters: about 4 MiB at worst; a
    :class:`Route` is immutable); refusals raise each time and are not cached."""
    if len(target) > _MAX_TARGET:
        raise RouteError(400, f"request target of {len(target)} characters (at most {_MAX_TARGET})")
    if not target.startswith("/"):
        form = ("absolute-form" if "://" in target else "asterisk-form" if target == "*" else "authority-form")
        raise RouteError(400, f"request target {target[:80]!r} is in {form}; only origin-form paths "
                              "(/v2/...) are accepted")
    if "?" in target or "#" in target:
        raise RouteError(400, "query strings and fragments are not accepted (the API takes none)")
    if "%" in target:
        raise RouteError(400, "percent-encoded request targets are not accepted (no served name needs one)")
    if "//" in target or "/./" in target or "/../" in target or target.endswith(("/.", "/..")):
        raise RouteError(400, "empty or dot segments are not accepted in the request target")
    path = target[:-1] if target.endswith("/") and len(target) > 1 else target
    for pattern, methods in _ROUTES:
        match = pattern.fullmatch(path)
        if match is None:
            continue
        if method not in methods:
            raise RouteError(405, f"{path[:80]} takes {', '.join(sorted(methods))}, not {method[:10]}")
        kind, category = methods[method]
        model = match.group(1) if pattern.pattern.startswith(("/v2/models/(", "/v2/repository/models/")) else None
        if model is not None and not MODEL_NAME.match(model):
            raise RouteError(400, f"model name {model[:60]!r} is not allowed (letters, digits, '_', '-', '.'; "
                                  "no path)")
        return Route(kind, category, path, model)
    raise RouteError(404, f"no such endpoint: {method[:10]} {path[:80]}")
