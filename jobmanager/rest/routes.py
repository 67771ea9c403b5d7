"""The REST API's URL map and request dispatch: a WSGI application over :class:`ClusterView`.

Werkzeug's routing does the matching (typed path parts, 404 for an unknown path, 405 with an
``Allow`` header for a wrong method, HEAD for every GET) so none of it is hand-written. Every
JSON answer is computed from values the view copied out of the JobManager, then encoded with no
lock held. Errors are Flink's ``{"errors": [...]}`` with a message naming the fix.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import re
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from keyedstate.common.auth import Permission
from keyedstate.common.errors import AuthenticationError, KeyedStateError, NotFoundError, PermissionDeniedError
from keyedstate.jobmanager.rest import documents as doc
from keyedstate.jobmanager.rest.access import Caller, RestAccess
from keyedstate.jobmanager.rest.view import ClusterView, JobView

logger = logging.getLogger(__name__)

OPENAPI = "openapi.json"
STATIC_FILES = ("index.html", "app.js", "style.css")
API_PREFIX = "/v1"
"""Flink serves its REST API under ``/v1`` as well as the root: both work here too."""

_RULES = Map(
    [
        Rule("/", endpoint="page"),
        Rule("/static/<name>", endpoint="static"),
        Rule(f"/{OPENAPI}", endpoint="openapi"),
        Rule("/config", endpoint="config"),
        Rule("/overview", endpoint="overview"),
        Rule("/jobs", endpoint="jobs"),
        Rule("/jobs/overview", endpoint="jobs_overview"),
        Rule("/jobs/<job_id>", endpoint="job"),
        Rule("/jobs/<job_id>/checkpoints", endpoint="checkpoints"),
        Rule("/jobs/<job_id>/checkpoints/config", endpoint="checkpoint_config"),
        Rule("/jobs/<job_id>/checkpoints/details/<int(signed=True):checkpoint_id>", endpoint="checkpoint"),
        Rule(
            "/jobs/<job_id>/checkpoints/details/<int(signed=True):checkpoint_id>/subtasks/<operator_id>",
            endpoint="subtasks",
        ),
        Rule("/taskmanagers", endpoint="taskmanagers"),
        Rule("/taskmanagers/<taskmanager_id>", endpoint="taskmanager"),
        Rule("/jobmanager/config", endpoint="jobmanager_config"),
    ],
    strict_slashes=False,
    merge_slashes=False,
)
# Only reads: werkzeug answers any other method with 405 and the Allow header.
for _rule in _RULES.iter_rules():
    _rule.methods = {"GET", "HEAD"}


def rest_paths() -> list[str]:
    """The JSON endpoints' paths in OpenAPI's notation (``/jobs/{jobid}``), for the document's tests."""
    names = {
        "job_id": "jobid",
        "checkpoint_id": "checkpointid",
        "operator_id": "vertexid",
        "taskmanager_id": "taskmanagerid",
    }
    paths = []
    for rule in _RULES.iter_rules():
        if rule.endpoint in ("page", "static", "openapi"):
            continue
        path = rule.rule
        for arg in rule.arguments:
            path = re.sub(r"<(?:[^:>]+:)?" + arg + ">", "{" + names[arg] + "}", path)
        paths.append(path)
    return paths


def _package_file(name: str) -> bytes:
    return (resources.files("keyedstate.jobmanager.rest") / name).read_bytes()


def _static_file(name: str) -> bytes:
    return (resources.files("keyedstate.jobmanager.rest") / "static" / name).read_bytes()


class RestApi:
    """The WSGI application of ``rest.port``: JSON endpoints, the OpenAPI document and the web page."""

    def __init__(self, view: ClusterView, access: RestAccess, refresh_interval_ms: int = 3000) -> None:
        self._view = view
        self._access = access
        self._refresh_ms = refresh_interval_ms
        # Read once: the package's own files do not change while the JobManager runs.
        self._openapi = _package_file(OPENAPI)
        self._static = {name: _static_file(name) for name in STATIC_FILES}
        self._handlers: dict[str, Callable[..., Any]] = {
            "config": lambda caller: doc.web_config(self._view.now_ms(), self._refresh_ms),
            "overview": self._overview,
            "jobs": self._jobs,
            "jobs_overview": self._jobs_overview,
            "job": self._job,
            "checkpoints": self._checkpoints,
            "checkpoint_config": self._checkpoint_config,
            "checkpoint": self._checkpoint,
            "subtasks": self._subtasks,
            "taskmanagers": self._taskmanagers,
            "taskmanager": self._taskmanager,
            "jobmanager_config": self._jobmanager_config,
        }

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """Serve one request (WSGI)."""
        path = environ.get("PATH_INFO", "") or "/"
        if path == API_PREFIX or path.startswith(API_PREFIX + "/"):
            environ["PATH_INFO"] = path[len(API_PREFIX) :] or "/"
        response = self._respond(Request(environ))
        return response(environ, start_response)

    # -- dispatch ------------------------------------------------------------------------------
    def _respond(self, request: Request) -> Response:
        try:
            endpoint, args = _RULES.bind_to_environ(request.environ).match()
            if endpoint == "page":
                return self._file(self._static["index.html"], "index.html")
            if endpoint == "static":
                return self._static_response(str(args["name"]))
            if endpoint == "openapi":
                return self._file(self._openapi, OPENAPI)
            caller = self._access.authenticate(request.headers.get("Authorization"), request.remote_addr or "?")
            return _json(200, self._handlers[str(endpoint)](caller, **args))
        except MethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.valid_methods or ()))
            response = _json(405, doc.error(f"{request.method} is not allowed on {request.path}: use {allowed}"))
            response.headers["Allow"] = allowed
            return response
        except NotFound:
            return _json(404, doc.error(f"no resource at {request.path}; the endpoints are listed in /{OPENAPI}"))
        except HTTPException as exc:
            return _json(exc.code or 400, doc.error(exc.description or exc.name))
        except AuthenticationError as exc:
            response = _json(401, doc.error(exc.message))
            response.headers["WWW-Authenticate"] = 'Bearer realm="keyedstate"'
            return response
        except PermissionDeniedError as exc:
            return _json(403, doc.error(exc.message))
        except NotFoundError as exc:
            return _json(404, doc.error(exc.message))
        except KeyedStateError as exc:
            return _json(400, doc.error(exc.message))
        except Exception:
            logger.exception("rest: %s %s failed", request.method, request.path)
            return _json(500, doc.error("internal error; the JobManager's log has the traceback"))

    def _file(self, body: bytes, name: str) -> Response:
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith(("javascript", "json")):
            kind += "; charset=utf-8"
        response = Response(body, 200, content_type=kind)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    def _static_response(self, name: str) -> Response:
        body = self._static.get(name)
        if body is None:
            raise NotFound()
        return self._file(body, name)

    # -- endpoints -----------------------------------------------------------------------------
    def _overview(self, caller: Caller) -> Any:
        RestAccess.require(caller, Permission.CLUSTER_VIEW)
        return doc.overview(self._view.cluster())

    def _visible_jobs(self, caller: Caller) -> list[JobView]:
        RestAccess.require(caller, Permission.JOB_VIEW)
        views = []
        for job_id in self._view.job_ids():
            if caller.covers(job_id):
                try:
                    views.append(self._view.job(job_id))
                except NotFoundError:
                    continue  # removed between the listing and the read
        return views

    def _jobs(self, caller: Caller) -> Any:
        return doc.job_ids(self._visible_jobs(caller))

    def _jobs_overview(self, caller: Caller) -> Any:
        return doc.jobs_overview(self._visible_jobs(caller), self._view.now_ms())

    def _one_job(self, caller: Caller, job_id: str) -> JobView:
        RestAccess.require(caller, Permission.JOB_VIEW, job_id)
        return self._view.job(job_id)

    def _job(self, caller: Caller, job_id: str) -> Any:
        return doc.job_details(self._one_job(caller, job_id), self._view.now_ms())

    def _job_checkpoints(self, caller: Caller, job_id: str) -> tuple[JobView, Any]:
        job = self._one_job(caller, job_id)
        if job.checkpoints is None:
            raise NotFoundError(
                f"job {job_id!r} has no checkpoints: the JobManager has no checkpoint storage; "
                "set state.checkpoints.dir"
            )
        return job, job.checkpoints

    def _checkpoints(self, caller: Caller, job_id: str) -> Any:
        _, stats = self._job_checkpoints(caller, job_id)
        return doc.checkpoints(stats)

    def _checkpoint_config(self, caller: Caller, job_id: str) -> Any:
        _, stats = self._job_checkpoints(caller, job_id)
        return doc.checkpoint_config(stats)

    def _entry(self, caller: Caller, job_id: str, checkpoint_id: int) -> tuple[JobView, Any]:
        job, stats = self._job_checkpoints(caller, job_id)
        for entry in stats.history:
            if entry.checkpoint_id == checkpoint_id:
                return job, entry
        held = ", ".join(str(e.checkpoint_id) for e in stats.history) or "none yet"
        raise NotFoundError(
            f"checkpoint {checkpoint_id} of job {job_id!r} is not in the checkpoint history (it holds {held}); "
            f"list the history at /jobs/{job_id}/checkpoints"
        )

    def _checkpoint(self, caller: Caller, job_id: str, checkpoint_id: int) -> Any:
        job, entry = self._entry(caller, job_id, checkpoint_id)
        return doc.checkpoint_details(entry, job)

    def _subtasks(self, caller: Caller, job_id: str, checkpoint_id: int, operator_id: str) -> Any:
        job, entry = self._entry(caller, job_id, checkpoint_id)
        op = next((o for o in job.info.operators if o.operator_id == operator_id), None)
        if op is None:
            known = ", ".join(o.operator_id for o in job.info.operators)
            raise NotFoundError(f"job {job_id!r} has no operator {operator_id!r} (its operators: {known})")
        return doc.checkpoint_subtasks(entry, operator_id, op.parallelism)

    def _taskmanagers(self, caller: Caller) -> Any:
        RestAccess.require(caller, Permission.CLUSTER_VIEW)
        return doc.taskmanagers(self._view.cluster(), self._view.now_ms())

    def _taskmanager(self, caller: Caller, taskmanager_id: str) -> Any:
        RestAccess.require(caller, Permission.CLUSTER_VIEW)
        return doc.taskmanager_details(self._view.taskmanager(taskmanager_id), self._view.now_ms())

    def _jobmanager_config(self, caller: Caller) -> Any:
        RestAccess.require(caller, Permission.CLUSTER_VIEW)
        return doc.jobmanager_config(self._view.configuration())


def _json(status: int, body: Any) -> Response:
    response = Response(json.dumps(body, separators=(",", ":")), status, content_type="application/json")
    response.headers["Cache-Control"] = "no-store"
    return response
