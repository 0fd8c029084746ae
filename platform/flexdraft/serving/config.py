"""What one replica serves (Serve's `user_config`, `ServeConfig`), building its engine, applying live policy
changes, and the fail-closed rule for serving beyond loopback."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from flexdraft.core import logs
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.registry import is_model_uri
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import LIVE_KNOBS, Engine  # (any change beyond LIVE_KNOBS needs a new engine)
from flexdraft.speculative.drafts import Mode
from flexdraft.speculative.policy_file import POLICY_KEYS


@dataclass
class ServeConfig:
    """What one replica serves (Serve's `user_config`): the model, the drafter, the runtime and the engine."""
    model: str = "smollm2"
    # "" = the default pipeline's if trained, else no drafter (see `build`); a folder; "init"; a registered version,
    # models:/NAME/VERSION or models:/NAME@ALIAS (downloaded by each replica from the tracking server)
    drafter: str = ""
    # with drafter models:/NAME@ALIAS: the version every replica loads (`flexdraft serve` pins the alias's version
    # when it deploys, so replicas that autoscaling adds later serve the same one; a new value rolls the replicas
    # over in place). "" = each replica resolves the alias when it starts
    drafter_version: str = ""
    store: str = ""  # n-gram store of lookup steps: "" = the default pipeline's distilled data, a file, "none"
    served_model_name: str = ""  # the `model` clients name ("" = the model source's name)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)  # (a config file's mapping of its fields)
    policy: str = ""  # a policy file from `flexdraft sweep`: it sets mode, S, B', pruning per live batch size
    default_max_tokens: int = 256  # new tokens of a request that names no max_tokens
    api_key_env: str = "FLEXDRAFT_API_KEY"  # when this variable is set, requests need `Authorization: Bearer <it>`
    mlflow_every_s: float = 30.0  # a serving run in MLflow, a point every this many seconds (0 = none)
    request_timeout_s: float = 600.0  # a request still decoding after this long ends with 504 (its row freed)
    drain_timeout_s: float = 60.0  # a reconfigure that needs a new engine lets the old one finish this long
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are read whole
    grammar_timeout_s: float = 5.0  # a response_format grammar that takes longer to compile is a 400
    insecure: bool = False  # serve beyond loopback without an API key (refused otherwise: fail closed)

    @classmethod
    def check_mapping(cls, data: dict) -> None:
        """A user_config mapping's engine keys that its policy file sets are refused (`from_dict` calls this)."""
        engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        both = [k for k in POLICY_KEYS if k in engine] if data.get("policy") else []
        if both:
            raise FlexDraftError(f"user_config.engine.{both[0]} is set by the policy file {data['policy']}: remove "
                                 f"{', '.join(both)} from engine (or the policy)")

    def __post_init__(self):

        if self.drafter_version and not ("@" in self.drafter and is_model_uri(self.drafter)
                                         and self.drafter_version.isdigit()):
            raise FlexDraftError(f"user_config.drafter_version {self.drafter_version!r} pins the version of a "
                                 "registered alias: it needs drafter: models:/NAME@ALIAS and a version number")
        if self.request_timeout_s <= 0 or self.drain_timeout_s < 0 or self.max_body_bytes < 1024 \
                or self.grammar_timeout_s <= 0:
            raise FlexDraftError("request_timeout_s and grammar_timeout_s must be > 0, drain_timeout_s >= 0 and "
                                 "max_body_bytes >= 1024")

    def needs_new_engine(self, other: ServeConfig) -> bool:
        """Whether going from `other` to this config changes more than the live knobs."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        for d in (a, b):
            d["engine"] = {k: v for k, v in d["engine"].items() if k not in LIVE_KNOBS}
        return a != b


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_exposure(cfg: ServeConfig, host: str | None, environ=os.environ) -> None:
    """Fail closed: serving on a non-loopback address (or one not known) needs an API key in
    `cfg.api_key_env`, unless `cfg.insecure` says otherwise."""
    if environ.get(cfg.api_key_env) or cfg.insecure or (host is not None and host in LOOPBACK_HOSTS):
        return
    raise FlexDraftError(f"refusing to serve on {host or 'an unknown address'} without an API key: set "
                         f"${cfg.api_key_env} in the replicas' environment (flexdraft serve forwards it), bind to "
                         "127.0.0.1, or set user_config.insecure: true (flexdraft serve --insecure)")


def drafter_spec(cfg: ServeConfig) -> str | None:
    """What the replica loads: `drafter`, or for an alias pinned by `drafter_version` that version
    (models:/NAME/VERSION); None = the default pipeline's."""
    if cfg.drafter_version:
        return f"{cfg.drafter.split('@')[0]}/{cfg.drafter_version}"
    return cfg.drafter or None


def build(cfg: ServeConfig):
    """-> (loaded model, engine, a note saying what it serves, where its drafter came from: `load_engine`). Without a drafter (none trained yet) an
    adaptive config serves in lookup mode: prompt-lookup and n-gram-store drafts verified by the target, AR steps
    where no row has a match; lossless and fast before anything is trained."""
    from flexdraft.engine.runner import load_engine

    ec = cfg.engine
    drafter = drafter_spec(cfg)
    if ec.mode == Mode.ADAPTIVE and not cfg.drafter and not cfg.policy:
        from flexdraft.drafter.recipe import default_drafter_dir

        if not (default_drafter_dir() / "drafter.json").is_file():
            ec = dataclasses.replace(ec, mode=Mode.LOOKUP)
            logs.get("serve").info(f"no trained drafter ({default_drafter_dir()} does not exist): serving in lookup "
                                   "mode (prompt lookup + n-gram store, AR steps elsewhere); train one with "
                                   "`flexdraft pipeline`")
    return load_engine(cfg.model, cfg.runtime, drafter, ec, store_spec=cfg.store or None,
                       policy_spec=cfg.policy or None)


def apply_live(engine: Engine, cfg: ServeConfig) -> dict:
    """Set the live knobs of `cfg.engine` on a running engine (on its thread: `AsyncEngine.call`) -> the changes."""
    new = cfg.engine
    knobs = [k for k in LIVE_KNOBS if engine.policy is None or k not in POLICY_KEYS]  # (a policy's are its own)
    return engine.reconfigure(**{k: getattr(new, k) for k in knobs})
