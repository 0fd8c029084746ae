"""Drafters in MLflow's model registry: one registered model per target model (`flexdraft-drafter-smollm2`),
one version per trained drafter, aliases (`champion`) to promote and roll back.

A drafter reference (REF) is a folder, `models:/NAME/VERSION`, `models:/NAME@ALIAS` or `models:/NAME/latest`.
`resolve` turns one into the folder the engine loads: a registered version is downloaded once into
`$FLEXDRAFT_HOME/registry/NAME/VERSION/` (a replica needs the tracking server, not a shared volume). Every
problem (unknown name, missing alias, another target's version, an unreachable server) is one FlexDraftError,
raised before any weights load.

Tags on a version (all `flexdraft.*`): the target (`base_model`, `base_fingerprint`), the shape (`k`,
`block_size`, `entry_layer`, `format`), validation tau, the training runs (`run.distill`, `run.attention`,
`run.calibration`), the data (`dataset.digest`), the weights' digest and the attached policy (`policy.*`).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flexdraft.core import logs
from flexdraft.core.config import data_dir
from flexdraft.core.errors import FlexDraftError
from flexdraft.core.tracking import tracking_uri

SCHEME = "models:/"
ARTIFACT = "drafter"  # the drafter folder inside the model's artifacts (artifacts/drafter/)
TAG = "flexdraft."
_REF = re.compile(r"^models:/(?P<name>[\w.-]+)(?:/(?P<version>\d+|latest)|@(?P<alias>[\w-]+))$")


def is_model_uri(ref: str | None) -> bool:
    return bool(ref) and str(ref).startswith(SCHEME)


def registered_name(base_model: str) -> str:
    """The registered model of drafters for one target: `flexdraft-drafter-<target name>` (lower-case, [a-z0-9-])."""
    stem = Path(base_model).name.removesuffix(".gguf") if "/" in base_model or base_model.endswith(".gguf") else base_model
    return "flexdraft-drafter-" + (re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "model")

log = logs.get("registry")


def weights_digest(folder: Path) -> str:
    """The sha256 (first 16 hex) of a drafter folder's weights file: what policies and versions are keyed by."""
    from flexdraft.drafter.model import WEIGHTS

    h = hashlib.sha256()
    with open(folder / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


@dataclass
class Version:
    """One registered drafter version, as the CLI and the report show it."""
    name: str
    version: str
    aliases: list[str]
    tags: dict[str, str]
    model_id: str  # the LoggedModel it was registered from ("" for an older source)
    run_id: str
    created_ms: int
    description: str = ""
    uri: str = field(init=False)

    def __post_init__(self):
        self.uri = f"{SCHEME}{self.name}/{self.version}"

    def tag(self, key: str, default: str = "") -> str:
        return self.tags.get(TAG + key, default)


def client():
    """An MlflowClient on the tracking URI; a tracking server that does not answer its health check within 5 s is
    a FlexDraftError at once (MLflow's own client would retry for minutes)."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                r.read()
        except OSError as e:
            raise FlexDraftError(f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) is unreachable: "
                                 f"{getattr(e, 'reason', e)}") from None
    elif uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise FlexDraftError(f"no MLflow store at {uri} (MLFLOW_TRACKING_URI): nothing registered there yet")
    return MlflowClient(uri)


def parse(ref: str) -> tuple[str, str | None, str | None]:
    """models:/NAME/VERSION | models:/NAME@ALIAS | models:/NAME/latest -> (name, version, alias)."""
    m = _REF.match(ref)
    if not m:
        raise FlexDraftError(f"{ref!r} is not a drafter model URI: expected models:/NAME/VERSION, models:/NAME@ALIAS "
                             "or models:/NAME/latest")
    return m["name"], m["version"], m["alias"]


def _version(mv, aliases: list[str] | None = None) -> Version:
    source = mv.source or ""
    model_id = getattr(mv, "model_id", None) or (source.removeprefix(SCHEME) if source.startswith(SCHEME + "m-") else "")
    return Version(mv.name, str(mv.version), list(aliases if aliases is not None else (mv.aliases or [])),
                   dict(mv.tags or {}), model_id, mv.run_id or "", int(mv.creation_timestamp or 0),
                   mv.description or "")


def lookup(ref: str, mlflow_client=None) -> Version:
    """The registered version a models:/ reference names; one-line errors for an unknown model, version or alias."""
    from mlflow.exceptions import MlflowException

    name, version, alias = parse(ref)
    c = mlflow_client or client()
    try:
        registered = c.get_registered_model(name)
    except MlflowException:
        known = sorted(m.name for m in c.search_registered_models(max_results=100))
        raise FlexDraftError(f"no registered model {name!r} in {c.tracking_uri}"
                             + (f" (registered: {', '.join(known)})" if known else " (nothing is registered there)")
                             + "; train one with `flexdraft pipeline`") from None
    aliases = dict(registered.aliases or {})  # alias -> version
    if alias is not None:
        if alias not in aliases:
            raise FlexDraftError(f"model {name!r} has no alias {alias!r}"
                                 + (f" (aliases: {', '.join(f'{a}=v{v}' for a, v in sorted(aliases.items()))})"
                                    if aliases else " (it has none)")
                                 + f"; set one with `flexdraft drafters promote models:/{name}/N --alias {alias}`")
        version = str(aliases[alias])
    elif version == "latest":
        versions = c.search_model_versions(f"name='{name}'", max_results=1, order_by=["version_number DESC"])
        if not versions:
            raise FlexDraftError(f"model {name!r} has no versions")
        version = str(versions[0].version)
    try:
        mv = c.get_model_version(name, version)
    except MlflowException:
        raise FlexDraftError(f"model {name!r} has no version {version}") from None
    return _version(mv, [a for a, v in aliases.items() if str(v) == str(mv.version)])


def resolve(ref: str, base_fingerprint: str | None = None) -> tuple[Path, Version | None]:
    """A drafter reference -> (the local folder to load, its registered version or None for a folder).
    base_fingerprint: the loaded target's (`Transformer.fingerprint`); a version registered for other weights is
    refused before its download. A version is downloaded once, into a folder keyed by name and version, and its
    weights are checked against the digest it was registered with, cached or not: a cached copy that differs (a
    byte changed on disk) is removed and downloaded again, a download that differs is refused."""
    if not is_model_uri(ref):
        return Path(ref).expanduser(), None
    v = lookup(ref)
    theirs = v.tag("base_fingerprint")
    if base_fingerprint and theirs and theirs != base_fingerprint:
        raise FlexDraftError(f"{ref} (version {v.version}) is a drafter for {v.tag('base_model', '?')} with weights "
                             f"fingerprint {theirs}; the loaded target's is {base_fingerprint}")
    cache = data_dir() / "registry" / v.name / v.version
    folder = cache / "artifacts" / ARTIFACT
    want = v.tag("weights_digest")
    if (folder / "drafter.json").is_file() and want and (have := weights_digest(folder)) != want:
        log.warning(f"the cached weights of {v.uri} ({cache}) have digest {have}, registered {want}: "
                    "removed, downloading them again")
        shutil.rmtree(cache, ignore_errors=True)
    if not (folder / "drafter.json").is_file():
        _download(v, cache)
        if want and (have := weights_digest(folder)) != want:
            shutil.rmtree(cache, ignore_errors=True)
            raise FlexDraftError(f"the downloaded weights of {v.uri} have digest {have}, not their registered "
                                 f"{want}: refused (the store holds other bytes than were registered)")
    return folder, v


def _download(v: Version, cache: Path) -> None:
    """Version `v`'s artifacts into `cache` (through a side folder: replicas sharing a cache download side by
    side, and a broken copy in the way is replaced)."""
    import mlflow

    folder = cache / "artifacts" / ARTIFACT
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        mlflow.set_tracking_uri(tracking_uri())
        mlflow.artifacts.download_artifacts(f"{SCHEME}{v.name}/{v.version}", dst_path=str(tmp))
    except Exception as e:  # noqa: BLE001 - any store or network failure is the user's one-line error
        shutil.rmtree(tmp, ignore_errors=True)
        raise FlexDraftError(f"could not download {v.uri}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    if not (tmp / "artifacts" / ARTIFACT / "drafter.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise FlexDraftError(f"{v.uri} holds no drafter (expected artifacts/{ARTIFACT}/drafter.json): "
                             "was it registered by `flexdraft pipeline`?")
    try:
        tmp.rename(cache)
    except OSError:  # another process finished first (or a broken copy is in the way: replaced)
        if not (folder / "drafter.json").is_file():
            shutil.rmtree(cache, ignore_errors=True)
            tmp.rename(cache)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def list_versions(name: str | None = None) -> list[Version]:
    """Every registered drafter version (of one registered model, or of every flexdraft-drafter-* model), newest
    first."""
    c = client()
    names = [name] if name else [m.name for m in c.search_registered_models(max_results=1000)
                                 if m.name.startswith("flexdraft-drafter-")]
    out = []
    for n in names:
        aliases = {}
        for a, ver in (c.get_registered_model(n).aliases or {}).items():
            aliases.setdefault(str(ver), []).append(a)
        for mv in c.search_model_versions(f"name='{n}'", max_results=1000):
            out.append(_version(mv, sorted(aliases.get(str(mv.version), []))))
    return sorted(out, key=lambda v: (v.name, -int(v.version)))


def promote(ref: str, alias: str) -> tuple[Version, str | None]:
    """Point `alias` of the version's registered model at it -> (the version, the version the alias named before)."""
    if not re.fullmatch(r"[A-Za-z][\w-]*", alias) or alias.lower() in ("latest",) or re.fullmatch(r"v\d+", alias):
        raise FlexDraftError(f"alias {alias!r} is not allowed: a name such as champion or canary "
                             "(not 'latest', not v<N>)")
    c = client()
    v = lookup(ref, c)
    before = (c.get_registered_model(v.name).aliases or {}).get(alias)
    c.set_registered_model_alias(v.name, alias, v.version)
    return lookup(f"{SCHEME}{v.name}/{v.version}", c), (str(before) if before is not None else None)


def set_tags(ref_or_version: str | Version, tags: dict[str, str]) -> None:
    """Add `flexdraft.<key>` tags to a registered version."""
    c = client()
    v = ref_or_version if isinstance(ref_or_version, Version) else lookup(ref_or_version, c)
    for k, val in tags.items():
        c.set_model_version_tag(v.name, v.version, TAG + k, str(val)[:5000])


def attach_policy(ref: str, run_id: str, artifact: str, sweep: str, objective: float) -> Version:
    """Record on a registered version that the sweep run `run_id` exported a policy for it (its artifact
    `artifact`): `--policy models:/NAME/VERSION` then loads that policy."""
    v = lookup(ref)
    set_tags(v, {"policy.uri": f"runs:/{run_id}/{artifact}", "policy.sweep": sweep, "policy.run_id": run_id,
                 "policy.objective": f"{objective:.4f}"})
    return v


def attached_policy(ref: str) -> Path:
    """The policy file a sweep attached to a registered version (`attach_policy`), downloaded once."""
    import mlflow

    v = lookup(ref)
    uri = v.tag("policy.uri")
    if not uri:
        raise FlexDraftError(f"{v.uri} has no policy attached: run a decode sweep on it "
                             f"(flexdraft sweep --config ... --drafter {v.uri}) or pass --policy FILE")
    dest = data_dir() / "registry" / v.name / f"{v.version}-policy-{v.tag('policy.run_id')[:12]}"
    path = dest / Path(uri).name
    if not path.is_file():
        mlflow.set_tracking_uri(tracking_uri())
        try:
            mlflow.artifacts.download_artifacts(uri, dst_path=str(dest))
        except Exception as e:  # noqa: BLE001
            raise FlexDraftError(f"could not download the policy {uri} of {v.uri}: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:300]}") from None
    return path
