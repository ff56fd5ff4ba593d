"""An OpenAI-compatible HTTP server over one ``LLM``: ``qaic-dynamo serve MODEL``.

:mod:`.app` builds the FastAPI app (completions, chat completions, streaming, models,
health, Prometheus metrics), :mod:`.async_engine` steps the engine on a thread of its own
for every client, :mod:`.protocol` holds the request bodies and :mod:`.metrics` the
Prometheus metrics.
"""

from qaic_dynamo.deploy.api_server.app import build_app
from qaic_dynamo.deploy.api_server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
