"""In-process fake of the Kubernetes REST API for tests. See README.md."""

from .server import FakeKubeAPI, RequestInfo
from .store import ApiError, ResourceType, Store

__all__ = ["FakeKubeAPI", "RequestInfo", "ApiError", "ResourceType", "Store"]
