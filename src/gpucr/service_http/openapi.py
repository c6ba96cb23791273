"""The HTTP API's OpenAPI schema (served at /openapi.json; tests/test_service_http.py runs schemathesis against a live
server with it). Field names and units as in docs/api.md: `_bytes` bytes, `_s` seconds, `_at` seconds since the epoch.
"""
from __future__ import annotations

from typing import Any

from ..levels import LEVELS
from ..swap.apps import NAME_MAX, STATES
from ..swap.service import PRIORITY_MAX, SECONDS_MAX as MAX_SECONDS
from ..swap.stats import DIRECTIONS, REFUSALS, RECENT_SWITCHES


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Any], extra: bool = False) -> dict[str, Any]:
    return {"type": "object", "required": list(props), "properties": props, "additionalProperties": extra}


INT, NUM, STR, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "boolean"}
BYTES = {"type": "integer", "minimum": 0}
NULL_NUM, NULL_STR = {"type": "number", "nullable": True}, {"type": "string", "nullable": True}
PER_GPU = {"type": "object", "additionalProperties": BYTES, "description": "GPU UUID -> bytes"}
PER_DIRECTION = _obj({d: INT for d in DIRECTIONS})

APP = _obj({
    "name": STR, "pid": INT, "priority": INT, "state": {"type": "string", "enum": list(STATES)},
    "held_bytes": PER_GPU, "peak_bytes": PER_GPU, "idle_s": NUM, "min_resident_s": NUM, "idle_park_s": NULL_NUM,
    "parks": INT, "resumes": INT, "last_wake_ms": NULL_NUM, "why": STR, "park_deadline_s": NUM,
    "wait_limit_s": NULL_NUM, "waiting": STR, "waiting_s": NULL_NUM, "any_gpu": BOOL,
    "park_level": {"type": "string", "enum": list(LEVELS)}, "host_bytes": BYTES,
    "image": NULL_STR, "gpus": {"type": "array", "items": STR}, "resident_bytes": BYTES, "parked_host_bytes": BYTES,
    "parked_disk_bytes": BYTES, "last_activity_at": NUM, "switches": PER_DIRECTION,
    "switch_seconds_sum": _obj({d: NUM for d in DIRECTIONS}),
    "switch_seconds_buckets": _obj({d: {"type": "array", "items": INT} for d in DIRECTIONS}),
    "bytes_moved": PER_DIRECTION, "bytes_skipped": PER_DIRECTION, "refusals": _obj({r: INT for r in REFUSALS}),
    "last_park_at": NULL_NUM, "last_resume_at": NULL_NUM,
    "last_bytes_per_second": {"type": "object", "additionalProperties": NULL_NUM},
    "missed_wakes": INT, "watch_restarts": INT,
})
GPU = _obj({"uuid": STR, "name": STR, "total_bytes": {**BYTES, "nullable": True},
            "used_bytes": {**BYTES, "nullable": True}, "apps_bytes": BYTES, "server_bytes": BYTES,
            "others_bytes": {**BYTES, "nullable": True},
            "apps": {"type": "object", "additionalProperties": BYTES, "description": "app name -> bytes"}})
SWITCH = _obj({"app": STR, "direction": {"type": "string", "enum": list(DIRECTIONS)}, "at": NUM, "seconds": NUM,
               "bytes_moved": BYTES, "bytes_skipped": BYTES, "control_s": NULL_NUM, "bytes_per_second": NULL_NUM,
               "two_way": BOOL, "phases_s": {"type": "object", "additionalProperties": NUM,
                                             "description": "phase -> seconds (the result's phases_s)"}})
STATE = _obj({"at": NUM, "server": {"type": "object"}, "host": {"type": "object"},
              "gpus": {"type": "array", "items": _ref("Gpu")}, "apps": {"type": "array", "items": _ref("App")},
              "switches": {"type": "array", "items": _ref("Switch")}})
HEALTH = _obj({"status": {"type": "string", "enum": ["ok"]}, "pid": INT, "simulated": BOOL, "up_s": NUM,
               "requests": INT, "in_flight": INT, "protocol": INT, "apps": INT})
POLICY = {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
    "priority": {"type": "integer", "minimum": -PRIORITY_MAX, "maximum": PRIORITY_MAX},
    "min_resident_s": {"type": "number", "minimum": 0, "maximum": MAX_SECONDS},
    "idle_park_s": {"type": "number", "minimum": 0, "maximum": MAX_SECONDS, "nullable": True,
                    "description": "null: never parked for idleness"}}}
EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": ["state", "error"]},
    "data": {"type": "string", "description": "JSON: a State (event state) or an Error (event error)"}}}
ERROR = _obj({"error": {"type": "string", "description": "one line, in the words of the gpucr command"}})


def _json(schema: dict[str, Any], what: str) -> dict[str, Any]:
    return {"description": what, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    said = {400: "malformed: the line says what is wrong", 401: "no token, or not this server's (loopback TCP)",
            403: "refused: another uid on the Unix socket, or a Host header not this server's",
            404: "no swap app of that name", 409: "refused now: the app is not in a state for it, or the park failed"}
    return {str(s): _json(_ref("Error"), said[s]) for s in (401, 403, *statuses)}


def _op(summary: str, ok: dict[str, Any], *errors: int, **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": ok, **_errors(*errors)}, **extra}


NAME = {"name": "name", "in": "path", "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": NAME_MAX}}
APP_OK = _json(_ref("App"), "the app, after the change")

SCHEMA: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "gpucr swap service", "version": "1",
             "description": "The swap service of `gpucr serve` (docs/swap.md, docs/api.md). On the server's Unix "
                            "socket no token is needed (the caller's uid is checked); on loopback TCP "
                            "(`gpucr serve --http`) every endpoint but the page wants `Authorization: Bearer TOKEN`."},
    "security": [{"token": []}],
    "paths": {
        "/api/v1/health": {"get": _op("the server's own health", _json(_ref("Health"), "it serves"))},
        "/api/v1/state": {"get": _op("everything the page shows: apps, GPUs, host memory, recent switches",
                                     _json(_ref("State"), "the state now"))},
        "/api/v1/events": {"get": _op("the state as server-sent events (`event: state`), one a second",
                                      {"description": "an endless event stream: each event's data is a State",
                                       "content": {"text/event-stream": {"schema": EVENT}}})},
        "/api/v1/gpus": {"get": _op("each GPU's memory, split by swap app, the server and others", _json(
            _obj({"gpus": {"type": "array", "items": _ref("Gpu")}}), "the machine's GPUs"))},
        "/api/v1/switches": {"get": _op("the recent parks and resumes, oldest first", _json(
            _obj({"switches": {"type": "array", "items": _ref("Switch")}}), "recent switches"), 400, parameters=[
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 0, "maximum": RECENT_SWITCHES}}])},
        "/api/v1/apps": {"get": _op("the swap apps", _json(_obj({"apps": {"type": "array", "items": _ref("App")}}),
                                                           "the apps, by name"))},
        "/api/v1/apps/{name}": {
            "parameters": [NAME],
            "get": _op("one swap app", _json(_ref("App"), "the app"), 404),
            "patch": _op("change its priority, min_resident_s or idle_park_s, from now", APP_OK, 400, 404, 409,
                         requestBody={"required": True, "content": {"application/json": {"schema": _ref("Policy")}}})},
        "/api/v1/apps/{name}/park": {"parameters": [NAME], "post": _op(
            "park it now: its GPU memory to host memory (its next demanding call resumes it)", APP_OK, 404, 409)},
        "/api/v1/apps/{name}/resume": {"parameters": [NAME], "post": _op(
            "resume it now", APP_OK, 404, 409)},
        "/metrics": {"get": _op("Prometheus metrics", {"description": "the text format", "content": {
            "text/plain": {"schema": {"type": "string"}}}})},
        "/openapi.json": {"get": _op("this schema", _json({"type": "object"}, "OpenAPI 3.0"))},
        "/": {"get": {"summary": "the live page (no data in it; its token comes from the URL fragment)",
                      "security": [], "responses": {"200": {"description": "the page", "content": {
                          "text/html": {"schema": {"type": "string"}}}},
                          "403": _json(_ref("Error"), "a Host header not this server's")}}},
    },
    "components": {
        "securitySchemes": {"token": {"type": "http", "scheme": "bearer",
                                      "description": "the token in the server's runtime dir (gpucr serve --show-http)"}},
        "schemas": {"App": APP, "Gpu": GPU, "Switch": SWITCH, "State": STATE, "Health": HEALTH, "Policy": POLICY,
                    "Error": ERROR},
    },
}
