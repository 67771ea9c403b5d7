"""The JobManager's REST API and web UI on ``rest.port`` (docs/rest.md).

``ClusterView`` reads the JobManager through its public queries, ``RestAccess`` applies the
gRPC API's tokens and roles, ``RestApi`` maps URLs to Flink-shaped JSON documents
(``openapi.json`` describes them) and serves the page under ``static/``, ``RestServer`` serves
it all over HTTP or HTTPS, one thread per request.
"""

from keyedstate.jobmanager.rest.access import RestAccess
from keyedstate.jobmanager.rest.routes import RestApi
from keyedstate.jobmanager.rest.server import RestServer
from keyedstate.jobmanager.rest.view import ClusterView

__all__ = ["ClusterView", "RestAccess", "RestApi", "RestServer"]
