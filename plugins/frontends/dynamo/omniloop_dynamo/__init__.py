"""omniloop-dynamo: serve an omniloop deployment as an NVIDIA Dynamo worker.

``omniloop dynamo-worker --deploy FILE`` (or ``python -m omniloop_dynamo.worker``) registers the
deployment's model with Dynamo (``ModelType.Videos`` / ``ModelType.Images``) so that Dynamo's
frontend serves ``POST /v1/videos`` and ``POST /v1/images/generations`` and routes across every
worker of the model. ai-dynamo is installed separately: ``plugins/frontends/dynamo/install-dynamo.sh``.
"""

from .protocol import InvalidRequest, MappedRequest, map_image_request, map_video_request

__all__ = ["InvalidRequest", "MappedRequest", "map_image_request", "map_video_request"]
