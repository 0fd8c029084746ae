"""The deploy entry of the FlexDraft Ray Serve app in a checkout (`serve run serve.app:build_app`; the KubeRay
RayService imports it from the image's /app): the deployment itself is `flexdraft.serving.ray_app`, which
serve/config.yaml imports directly.

    serve run serve.app:build_app          # or: serve run serve/config.yaml, or: flexdraft serve
"""
from flexdraft.serving.ray_app import FlexDraftServer, app, build_app  # noqa: F401 - what Serve imports

__all__ = ["FlexDraftServer", "app", "build_app"]
