"""Drafters in MLflow's model registry, against a real `mlflow server` (SQLite behind it; PostgreSQL with
`pytest -m postgres tests/drafter/test_registry.py`): a registered drafter resolves from `models:/` URIs through
the server into a local cache (once) and decodes exactly as its folder does; promotion moves what `@champion`
loads; a sweep's policy attached to a version loads by the version's URI; every bad reference is one line, before
any weights load."""
import json
import shutil
import time
import zlib

import pytest

from conftest import free_port, make_tiny_hf, postgres_store, recorded_pipeline, start_mlflow_server
from flexdraft.cli.main import main
from flexdraft.core.config import from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.common import run_key


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"mlflow-{request.param}")
    stop = lambda: None
    if request.param == "postgres":
        store, stop = postgres_store(root)
    else:
        store = f"sqlite:///{root / 'mlflow.db'}"
    proc, uri = start_mlflow_server(store, root)
    yield uri
    proc.terminate()
    proc.wait(30)
    stop()


@pytest.fixture
def home(server, tmp_path, monkeypatch):
    """This test's FLEXDRAFT_HOME (the registry's download cache) and the server as its tracking URI."""
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


@pytest.fixture
def data(tiny_pipeline):
    return from_dict(PipelineConfig, tiny_pipeline[1]).distill_dir()


@pytest.fixture
def model(tiny_smollm2, tmp_path, request):
    """The tiny SmolLM2-shaped model under a name of this test's own (its registered model is
    flexdraft-drafter-<name>: tests sharing the server do not share versions)."""
    link = tmp_path / f"t{zlib.crc32(request.node.nodeid.encode()):08x}"
    link.symlink_to(tiny_smollm2)
    return link


def generate(capsys, model, drafter, *extra) -> tuple[int, list, str]:
    code = main(["generate", "--model", str(model), "--drafter", drafter, "--prompt", "Hello there", "--json",
                 "--max-new-tokens", "12", *extra])
    out = capsys.readouterr()
    return code, [json.loads(line)["token_ids"] for line in out.out.splitlines() if line.startswith("{")], out.err


def test_a_registered_drafter_decodes_from_its_uri_exactly_as_from_its_folder(home, model, data, tmp_path, capsys):
    """The pipeline's registration: version 1 of flexdraft-drafter-tiny, alias champion, tagged with the target,
    shape, tau, the runs of each stage and the data set; registering again keeps it. `models:/...@champion`
    downloads it once into $FLEXDRAFT_HOME/registry through the server and decodes token for token as the folder
    (and as AR: lossless). `drafters list/show` show it."""
    from mlflow.tracking import MlflowClient

    from flexdraft.drafter.registry import lookup
    from flexdraft.training.register import register_drafter

    cfg = recorded_pipeline(model, tmp_path, "one", data, seed=1)
    name = f"flexdraft-drafter-{model.name}"
    uri = register_drafter(cfg)
    assert uri == f"models:/{name}/1" and register_drafter(cfg) == uri
    v = lookup(f"models:/{name}@champion")
    runs = {s: (cfg.root / f"{s}-{run_key(cfg, s)}.mlflow-run").read_text() for s in ("attention", "calibration")}
    assert (v.version, v.aliases, v.tag("k"), v.tag("block_size"), v.tag("tau.bonus")) == ("1", ["champion"], "2", "4",
                                                                                         "1.2600")
    assert v.tag("run.attention") == runs["attention"] and v.tag("run.calibration") == runs["calibration"]
    assert v.tag("dataset.sequences") == "24" and v.tag("dataset.digest") and v.model_id.startswith("m-")
    logged = MlflowClient().get_logged_model(v.model_id)
    assert logged.source_run_id == runs["calibration"] and v.run_id == runs["calibration"]
    assert name in logged.tags["mlflow.modelVersions"]  # (the UI's link from the logged model to its version)
    # its validation tau, linked to the model and to the data set it was measured on
    assert {m.dataset_digest for m in logged.metrics} == {v.tag("dataset.digest")} and logged.metrics

    code, from_uri, err = generate(capsys, model, f"models:/{name}@champion")
    assert code == 0 and f"models:/{name}@champion (version 1)" in err
    cached = home / "registry" / name / "1" / "artifacts" / "drafter" / "drafter.safetensors"
    stamp = cached.stat().st_mtime_ns
    assert generate(capsys, model, str(cfg.drafter_dir("calibration")))[1] == from_uri
    assert generate(capsys, model, f"models:/{name}/1", "--mode", "ar")[1] == from_uri
    assert cached.stat().st_mtime_ns == stamp  # downloaded once

    # the MLflow model itself: pyfunc.load_model + predict answers a chat prompt as `generate --chat` does
    import mlflow

    answer, = mlflow.pyfunc.load_model(f"models:/{name}@champion").predict(["Hello there"],
                                                                          params={"max_new_tokens": 12})
    assert main(["generate", "--model", str(model), "--drafter", f"models:/{name}/1", "--chat", "--prompt",
                 "Hello there", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == answer.strip()

    assert main(["drafters", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"models:/{name}/1" in listed and "champion" in listed
    assert main(["drafters", "show", f"models:/{name}/latest"]) == 0
    shown = capsys.readouterr().out
    assert runs["calibration"] in shown and "dataset.digest" in shown
    # the lineage and the report, from the MLflow API: the runs that made it, the page with its validation tau
    assert main(["drafters", "lineage", f"models:/{name}@champion"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:5]] == ["dataset", "distill", "attention", "calibration", "model"]
    assert runs["attention"][:8] in lines[2] and runs["calibration"][:8] in lines[3] and v.model_id in lines[4]
    assert main(["report", f"models:/{name}@champion", "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>Validation</h2>" in page and "1.2600" in page and runs["calibration"][:8] in page
    assert lookup(f"models:/{name}/1").tag("report.last_run")


def test_promoting_another_version_switches_what_the_alias_loads_and_its_policy_follows_the_version(
        home, model, data, tmp_path, capsys):
    """A second drafter registers as version 2 without taking champion; `drafters promote` moves champion to it and
    `@champion` then loads version 2's weights (another cache folder); a cached copy altered by one byte is
    downloaded again, and a store holding other bytes than were registered is refused. A policy attached to version 2 (as a decode
    sweep attaches its export) loads by `--policy models:/.../2`, and is refused for version 1's weights."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from flexdraft.cli.serve import pin_drafter
    from flexdraft.drafter.registry import TAG, attach_policy, lookup, resolve
    from flexdraft.models.loading import load_model
    from flexdraft.serving.config import ServeConfig, drafter_spec
    from flexdraft.speculative.policy_file import Band, Policy, save_policy
    from flexdraft.training.register import register_drafter

    champion = f"models:/flexdraft-drafter-{model.name}@champion"
    first = register_drafter(recorded_pipeline(model, tmp_path, "one", data, seed=1))
    second = register_drafter(recorded_pipeline(model, tmp_path, "two", data, seed=2))
    assert second.endswith("/2") and lookup(champion).version == "1"
    before, _ = resolve(champion)
    assert main(["drafters", "promote", second, "--alias", "champion"]) == 0
    assert "-> version 2 (was version 1)" in capsys.readouterr().out
    after, v = resolve(champion)
    assert v.version == "2" and after != before

    # the cache is checked on every load: one byte changed on disk -> refused, removed, downloaded again
    weights = after / "drafter.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    capsys.readouterr()
    again, _ = resolve(champion)
    assert again == after and weights.read_bytes() == good
    assert f"registered {v.tag('weights_digest')}: removed, downloading them again" in capsys.readouterr().err
    # a store whose bytes differ from what was registered is refused, in one line naming both digests
    MlflowClient().set_model_version_tag(v.name, v.version, TAG + "weights_digest", "0" * 16)
    with pytest.raises(FlexDraftError, match=f"have digest {v.tag('weights_digest')}, not their registered 0{{16}}"):
        resolve(champion)
    MlflowClient().set_model_version_tag(v.name, v.version, TAG + "weights_digest", v.tag("weights_digest"))
    assert resolve(champion)[0] == after and weights.read_bytes() == good  # (downloaded afresh once it matches)
    user = {"drafter": champion}  # what `flexdraft serve` deploys: the alias's version now, for every replica
    pin_drafter(user)
    assert user["drafter_version"] == "2" and drafter_spec(from_dict(ServeConfig, user)) == second
    assert (after / "drafter.safetensors").read_bytes() != (before / "drafter.safetensors").read_bytes()

    fp = load_model(model, with_tokenizer=False).model.fingerprint
    policy = save_policy(Policy(switch_batch=2, bands=[Band(1, "parallel", block=2), Band(None, "sequential")],
                                target={"model": "tiny", "fingerprint": fp},
                                drafter={"path": second, "fingerprint": v.tag("weights_digest"), "block_size": 4}),
                         tmp_path / "policy.yaml")
    with mlflow.start_run() as run:  # the sweep's parent run holds the exported policy
        mlflow.log_artifact(str(policy))
    attach_policy(second, run.info.run_id, "policy.yaml", "decode-test", 1.1)
    code, with_policy, err = generate(capsys, model, second, "--policy", second)
    assert code == 0 and "policy" in err
    assert generate(capsys, model, second, "--mode", "ar")[1] == with_policy  # lossless
    code, _, err = generate(capsys, model, first, "--policy", second)
    assert code == 2 and "another drafter" in err and err.count("\n") == 1


@pytest.mark.parametrize("ref,needle", [
    ("models:/flexdraft-drafter-nope@champion", "no registered model 'flexdraft-drafter-nope'"),
    ("models:/NAME@canary", "has no alias 'canary' (aliases: champion=v1)"),
    ("models:/NAME/9", "has no version 9"),
    ("models:/NAME", "is not a drafter model URI"),
    ("models:/NAME/1", "is a drafter for"),  # asked for by a model with other weights
    ("unreachable", "is unreachable"),
], ids=["unknown-model", "missing-alias", "missing-version", "malformed", "other-target", "server-down"])
def test_a_bad_reference_is_one_line_before_any_weights_load(home, model, data, tmp_path, capsys, monkeypatch,
                                                             ref, needle):
    """Each through `flexdraft generate`: exit 2, one line naming the problem, nothing downloaded. The other
    target: a tiny model with other weights asked to load the drafter registered for `tiny`."""
    from flexdraft.training.register import register_drafter

    register_drafter(recorded_pipeline(model, tmp_path, "one", data, seed=1))
    ref = ref.replace("NAME", f"flexdraft-drafter-{model.name}")
    asking = model
    if needle == "is a drafter for":
        asking = tmp_path / "other"
        make_tiny_hf("llama", asking, seed=7, vocab_size=49152, max_position_embeddings=512)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(model / f, asking / f)
    if ref == "unreachable":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
        ref = f"models:/flexdraft-drafter-{model.name}@champion"
    capsys.readouterr()  # (what registering printed)
    t0 = time.perf_counter()
    code, _, err = generate(capsys, asking, ref)
    assert code == 2 and needle in err and err.count("\n") == 1, err
    assert time.perf_counter() - t0 < 60  # (no retrying for minutes)
    assert not (home / "registry").exists()
