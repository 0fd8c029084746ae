"""The deploy entry of the FlexDraft Ray Serve app (serve/config.yaml's `import_path: serve.app:build_app`):
the deployment itself is `flexdraft.serving.ray_app`, importable from an installed package too.

    serve run serve/config.yaml            # or: serve run serve.app:build_app, or: flexdraft serve
"""
from flexdraft.serving.ray_app import FlexDraftServer, app, build_app  # noqa: F401 - what Serve imports

__all__ = ["FlexDraftServer", "app", "build_app"]
