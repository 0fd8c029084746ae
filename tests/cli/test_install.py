"""A non-editable install works outside the repository: `pip install .` into a fresh venv (its dependencies seen
through this venv's site-packages, but not this checkout: the editable install's path hook is not loaded), then,
from a directory outside the repository, every command that reads a config finds it inside the package."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ENV, REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """-> (the fresh venv's bin folder, a working directory outside the repository)."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # a plain path entry: this venv's packages, without running its .pth files (the editable install's among them)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the checkout's files as a clean source tree (building in place would write egg-info and build/ into it)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout
    subprocess.run(["tar", "-cf", str(root / "src.tar"), "--null", "-T", "-"], input=files, cwd=REPO, check=True)
    (root / "src").mkdir()
    subprocess.run(["tar", "-xf", str(root / "src.tar"), "-C", str(root / "src")], check=True)
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "pip", "install", "--python", str(venv / "bin" / "python"), "--no-deps",
                    "--no-build-isolation", "--quiet", str(root / "src")], check=True,
                   env={**ENV, "UV_NO_CACHE": "1"}, capture_output=True, cwd=root)
    work = root / "elsewhere"
    work.mkdir()
    return venv / "bin", work


def run(installed, *argv, timeout=300):
    bin_, work = installed
    env = {**ENV, "PATH": f"{bin_}:{ENV['PATH']}", "PYTHONPATH": "", "FLEXDRAFT_HOME": str(work / "home")}
    env.pop("FLEXDRAFT_API_KEY", None)  # (serve's fail-closed check below is about a server without a key)
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_not_the_checkout(installed):
    """The fresh venv imports flexdraft from its own site-packages, and the package carries its configs, its
    licence text and metadata."""
    out = run(installed, "python", "-c", "import flexdraft, flexdraft.core.config as c; "
              "print(flexdraft.__file__); print(sorted(p.name for p in c.CONFIGS.rglob('*.yaml')))")
    assert out.returncode == 0, out.stderr
    where, names = out.stdout.splitlines()
    assert str(REPO) not in where and "site-packages" in where
    for name in ("demo.yaml", "smollm2.yaml", "config.yaml", "local.yaml", "decode.yaml", "training.yaml", "full.yaml"):
        assert name in names
    # its metadata names the licence (what `pip show flexdraft` prints) and ships the licence text
    out = run(installed, "python", "-c", "import importlib.metadata as m; d = m.distribution('flexdraft'); "
              "print(d.metadata['License-Expression']); print(d.metadata['Requires-Python']); "
              "print(any(f.name == 'LICENSE' for f in d.files))")
    assert out.stdout.split() == ["Apache-2.0", "==3.11.*", "True"], out.stdout + out.stderr


def test_commands_run_from_outside_the_repository(installed, tiny_smollm2):
    """generate decodes; serve loads its packaged Serve config (and fails closed on a public address without a
    key, before Ray starts); sweep runs its Tune driver module with the packaged decode config (refusing a missing
    drafter in its checks); demo's pipeline, benchmark and Serve configs load, and the Serve app they name imports."""
    out = run(installed, "flexdraft", "generate", "--model", str(tiny_smollm2), "--prompt", "hi", "--mode", "ar",
              "--max-new-tokens", "3", "--json", "--dtype", "float32", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 3

    out = run(installed, "flexdraft", "serve", "--host", "0.0.0.0")
    assert out.returncode == 2 and "0.0.0.0" in out.stderr and "API key" in out.stderr, out.stderr

    out = run(installed, "flexdraft", "sweep", "--config", "tuning/configs/decode.yaml",
              "--drafter", "/nonexistent/drafter")
    assert out.returncode == 2 and "/nonexistent/drafter" in out.stderr, out.stderr

    script = ("from flexdraft.cli import demo; from flexdraft.drafter.recipe import load_pipeline_config; "
              "from flexdraft.core.config import load_yaml; from flexdraft.evaluation.harness import HarnessConfig; "
              "import importlib, yaml; cfg = load_pipeline_config(demo.DEMO_PIPELINE); "
              "load_yaml(HarnessConfig, demo.DEMO_BENCH); "
              "serve = yaml.safe_load(demo._serve_config(cfg, 'models:/flexdraft-drafter-smollm2/1').read_text()); "
              "paths = {a['import_path'] for a in serve['applications']}; "
              "[getattr(importlib.import_module(p.split(':')[0]), p.split(':')[1]) for p in paths]; print(paths)")
    out = run(installed, "python", "-c", script)
    assert out.returncode == 0, out.stderr
    assert "flexdraft.serving.ray_app:build_app" in out.stdout


def test_every_module_the_package_imports_comes_with_its_declared_dependencies():
    """Each third-party module the package imports (anywhere, lazily or not) belongs to a distribution that
    `[project.dependencies]` installs, directly or through the dependencies of those (their extras as declared):
    a runtime dependency missing from pyproject fails here, though the dev venv that the install test borrows
    holds it. The peers' workers run in the peer's own venv and are left out."""
    import ast
    import importlib.metadata as md
    import re
    import tomllib

    from packaging.requirements import Requirement

    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    declared = [Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    closure, todo = set(), [(norm(r.name), set(r.extras)) for r in declared]
    while todo:
        name, extras = todo.pop()
        if (name, frozenset(extras)) in closure:
            continue
        closure.add((name, frozenset(extras)))
        for spec in md.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((norm(req.name), set(req.extras)))
    installed = {name for name, _ in closure}
    modules: dict[str, str] = {}
    for path in (REPO / "platform" / "flexdraft").rglob("*.py"):
        if path.parent.name == "peers" and path.stem.endswith("_worker"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "flexdraft":
                    modules.setdefault(top, str(path.relative_to(REPO)))
    owners = md.packages_distributions()
    missing = {m: where for m, where in modules.items() if not {norm(d) for d in owners.get(m, [])} & installed}
    assert len(modules) > 10 and not missing, f"imported but not installed by [project.dependencies]: {missing}"
