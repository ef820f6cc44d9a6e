"""The two images, checked without a Docker engine: syntax, build context, entrypoints, install step."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from diloco.cli import SUBCOMMANDS
from tests.images.dockerfile import (
    Dockerfile,
    DockerfileError,
    Instruction,
    copy_flags,
    copy_paths,
    dockerignore_excludes,
    parse,
    substitute,
)

ROOT = Path(__file__).resolve().parents[2]
# image file, extras it installs, subcommand of its entrypoint, source folders it must not carry
IMAGES = {
    "Dockerfile.sync": ("sync,operator", "synchronizer", {"worker", "bench"}),
    "Dockerfile.worker": ("worker", "worker", {"synchronizer", "operator", "bench"}),
}
OCI_LABELS = ("title", "description", "version", "revision", "created", "licenses", "source")


def _read(name: str) -> Dockerfile:
    return parse((ROOT / name).read_text())


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _env_of(stage_instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage_instructions:
        if instruction.keyword == "ENV":
            for word in shlex.split(instruction.arguments):
                key, _, value = word.partition("=")
                env[key] = value
    return env


@pytest.fixture(params=sorted(IMAGES))
def image(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_parser_rejects_what_buildkit_rejects() -> None:
    with pytest.raises(DockerfileError, match="unknown instruction 'RUNN'"):
        parse("FROM python:3.11-slim\nRUNN echo hi\n")
    with pytest.raises(DockerfileError, match="--from=builder names no earlier stage"):
        parse("FROM python:3.11-slim AS build\nFROM python:3.11-slim\nCOPY --from=builder /a /b\n")
    with pytest.raises(DockerfileError, match=r"uses \$TAG, which no ARG"):
        parse("FROM python:${TAG}-slim\n")
    with pytest.raises(DockerfileError, match="only ARG may come before the first FROM"):
        parse("RUN true\nFROM python:3.11-slim\n")
    with pytest.raises(DockerfileError, match="ends inside a continued instruction"):
        parse("FROM python:3.11-slim\nRUN true \\\n")
    with pytest.raises(DockerfileError, match="malformed JSON"):
        parse('FROM python:3.11-slim\nENTRYPOINT ["diloco", \n').stages[0].instructions[0].exec_form()


def test_dockerignore_matcher_follows_docker_rules() -> None:
    rules = "*\n!core/\n**/__pycache__\n"
    assert dockerignore_excludes(rules, ".venv/bin/python")
    assert not dockerignore_excludes(rules, "core/diloco_core/config.py")
    assert dockerignore_excludes(rules, "core/diloco_core/__pycache__/config.cpython-311.pyc")


def test_dockerfile_parses_into_a_build_and_a_runtime_stage(image: str) -> None:
    dockerfile = _read(image)
    assert [s.name for s in dockerfile.stages] == ["build", "runtime"]
    assert dockerfile.directives.get("syntax") == "docker/dockerfile:1"
    # the runtime stage takes only the virtual environment from the build stage
    copies = [i for i in dockerfile.stage("runtime").instructions if i.keyword == "COPY"]
    assert [(copy_flags(i).get("from"), copy_paths(i)) for i in copies] == [
        ("build", (["/opt/diloco"], "/opt/diloco"))
    ]


def test_base_images_are_official_python_3_11_slim_with_a_pinned_patch_version(image: str) -> None:
    dockerfile = _read(image)
    args = {k: v or "" for k, v in dockerfile.global_args.items()}
    assert re.fullmatch(r"3\.11\.\d+", args["PYTHON_VERSION"]), args
    for stage in dockerfile.stages:
        base = substitute(stage.base, args)
        assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", base), base


def test_every_copied_source_exists_and_is_in_the_build_context(image: str) -> None:
    dockerignore = (ROOT / ".dockerignore").read_text()
    copies = [i for i in _read(image).all("COPY") if "from" not in copy_flags(i)]
    assert copies, "the build stage copies the project"
    for instruction in copies:
        sources, _ = copy_paths(instruction)
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"{image} line {instruction.line}: {source} does not exist"
            assert not dockerignore_excludes(
                dockerignore, source.rstrip("/")
            ), f"{image} line {instruction.line}: .dockerignore leaves {source} out of the build context"
    assert dockerignore_excludes(dockerignore, ".venv/bin/python")
    assert dockerignore_excludes(dockerignore, ".git/HEAD")
    assert dockerignore_excludes(dockerignore, "tests/conftest.py")


def test_image_copies_only_the_code_it_runs(image: str) -> None:
    _, _, unwanted = IMAGES[image]
    copied = {copy_paths(i)[0][0].strip("/").split("/")[0] for i in _read(image).all("COPY")}
    assert not copied & unwanted, f"{image} copies {copied & unwanted}, which it never runs"


def test_runtime_runs_as_numeric_non_root_user_10001(image: str) -> None:
    runtime = _read(image).stage("runtime")
    users = [i.arguments for i in runtime.instructions if i.keyword == "USER"]
    assert users == ["10001:10001"], "a numeric uid lets Kubernetes verify runAsNonRoot"
    text = " ".join(i.arguments for i in runtime.instructions if i.keyword == "RUN")
    assert "--uid 10001" in text
    assert "--gid 10001" in text


def test_runtime_carries_the_oci_labels(image: str) -> None:
    labels = " ".join(i.arguments for i in _read(image).stage("runtime").instructions if i.keyword == "LABEL")
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in labels, label


def test_entrypoint_is_the_diloco_console_script_with_an_existing_subcommand(image: str) -> None:
    _, subcommand, _ = IMAGES[image]
    entrypoints = [i for i in _read(image).stage("runtime").instructions if i.keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    assert entrypoints[0].exec_form() == ["diloco", subcommand], "exec form, so that signals reach diloco"
    assert _pyproject()["project"]["scripts"]["diloco"] == "diloco.cli:main"
    assert subcommand in SUBCOMMANDS
    # the module the subcommand dispatches to is part of the sources the image copies
    module = SUBCOMMANDS[subcommand][0]
    package = module.split(".")[0]
    folder = {"diloco": "diloco", "diloco_sync": "synchronizer", "diloco_worker": "worker"}[package]
    copied = {copy_paths(i)[0][0].strip("/") for i in _read(image).all("COPY")}
    assert folder in copied


def test_sync_image_also_carries_the_operator() -> None:
    """The chart runs the operator from the synchronizer image with command ["diloco", "operator"]."""
    dockerfile = _read("Dockerfile.sync")
    copied = {copy_paths(i)[0][0].strip("/") for i in dockerfile.all("COPY")}
    assert "operator" in copied
    assert "operator" in SUBCOMMANDS
    assert SUBCOMMANDS["operator"][0].startswith("diloco_operator.")


def test_install_step_installs_the_image_extras_and_the_sync_image_gets_no_torch(image: str) -> None:
    extras, _, _ = IMAGES[image]
    runs = [i.arguments for i in _read(image).stage("build").instructions if i.keyword == "RUN"]
    installs = [r for r in runs if f'pip install --no-cache-dir ".[{extras}]"' in r]
    assert len(installs) == 1, runs
    optional = _pyproject()["project"]["optional-dependencies"]
    requirements = [r for extra in extras.split(",") for r in optional[extra]] + _pyproject()["project"][
        "dependencies"
    ]
    has_torch = any(re.match(r"torch\b", r) for r in requirements)
    assert has_torch == (image == "Dockerfile.worker")


def test_healthcheck_only_in_the_sync_image_kubernetes_probes_the_learner() -> None:
    sync = [i for i in _read("Dockerfile.sync").stage("runtime").instructions if i.keyword == "HEALTHCHECK"]
    worker = [
        i for i in _read("Dockerfile.worker").stage("runtime").instructions if i.keyword == "HEALTHCHECK"
    ]
    assert len(sync) == 1
    assert "/healthz" in sync[0].arguments
    assert [i.arguments for i in worker] == ["NONE"]


def test_sync_image_environment_makes_the_synchronizer_listen_where_the_operator_expects(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from diloco_operator import env as operator_env
    from diloco_operator.cli import parse_args
    from diloco_operator.settings import OperatorSettings
    from diloco_sync.cli import parse_settings

    runtime = _read("Dockerfile.sync").stage("runtime")
    image_env = _env_of(runtime.instructions)
    for key in [k for k in os.environ if k.startswith("DILOCO_")]:
        monkeypatch.delenv(key)
    for key in ("DILOCO_HOST", "DILOCO_PORT"):
        monkeypatch.setenv(key, image_env[key])
    monkeypatch.setenv("DILOCO_JOB_SECRET", "s" * 32)
    monkeypatch.setenv("DILOCO_DATA_DIR", str(tmp_path))
    # the synchronizer's own default is loopback: the image must open it to the pod network
    settings = parse_settings([])
    assert (settings.host, settings.port) == ("0.0.0.0", operator_env.SYNC_PORT)
    exposed = {int(p) for i in runtime.instructions if i.keyword == "EXPOSE" for p in i.arguments.split()}
    operator_ports = {urlsplit(parse_args([]).liveness).port, OperatorSettings().metrics_port}
    assert exposed == {operator_env.SYNC_PORT} | operator_ports


def test_worker_image_exposes_the_learner_health_port() -> None:
    from diloco_operator import env as operator_env

    runtime = _read("Dockerfile.worker").stage("runtime")
    assert [i.arguments for i in runtime.instructions if i.keyword == "EXPOSE"] == [
        str(operator_env.HEALTH_PORT)
    ]


def _replay_build_stage(image: str, tmp_path: Path, *, reuse_pip_cache: bool) -> Path:
    """Run the build stage's COPY and RUN steps here: the context is a copy of exactly what the
    Dockerfile copies, /opt/diloco becomes a folder under tmp_path. Returns the virtual environment."""
    stage = _read(image).stage("build")
    context = tmp_path / "src"
    venv = tmp_path / "opt-diloco"
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python").symlink_to(sys.executable)
    env = {**os.environ, **_env_of(stage.instructions), "PATH": f"{shims}:{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    if reuse_pip_cache:
        env.pop("PIP_NO_CACHE_DIR", None)
    ignored = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".mypy_cache")
    context.mkdir()
    for instruction in stage.instructions:
        if instruction.keyword == "COPY":
            sources, destination = copy_paths(instruction)
            for source in sources:
                target = (
                    context / destination if destination.endswith("/") and destination != "./" else context
                )
                src = ROOT / source
                if src.is_dir():
                    shutil.copytree(src, target, ignore=ignored, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, context / src.name)
        elif instruction.keyword == "RUN":
            command = instruction.arguments.replace("/opt/diloco", str(venv))
            if reuse_pip_cache:
                command = command.replace(" --no-cache-dir", "")
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command],
                cwd=context,
                env=env,
                capture_output=True,
                text=True,
                timeout=1500,
            )
            assert result.returncode == 0, f"{image} line {instruction.line} failed:\n{result.stderr[-4000:]}"
    return venv


def _venv_python(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )


@pytest.mark.integration
@pytest.mark.slow
def test_sync_image_install_step_works_in_a_clean_venv(tmp_path: Path) -> None:
    venv = _replay_build_stage("Dockerfile.sync", tmp_path, reuse_pip_cache=False)
    found = _venv_python(
        venv,
        "import importlib.util as u; "
        "print(*[bool(u.find_spec(m)) for m in ('diloco_sync', 'diloco_operator', 'fastapi', 'uvicorn', "
        "'kopf', 'kubernetes', 'prometheus_client', 'torch', 'diloco_worker')])",
    )
    assert found.returncode == 0, found.stderr
    # the service, the operator and their libraries are there; PyTorch and the learner are not
    assert found.stdout.split() == ["True"] * 7 + ["False", "False"]
    listed = subprocess.run(
        [str(venv / "bin" / "diloco"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0
    assert "synchronizer" in listed.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_worker_image_install_step_works_in_a_clean_venv(tmp_path: Path) -> None:
    venv = _replay_build_stage("Dockerfile.worker", tmp_path, reuse_pip_cache=True)
    found = _venv_python(
        venv,
        "import importlib.util as u, torch; "
        "print(torch.__version__, *[bool(u.find_spec(m)) for m in ('diloco_worker', 'safetensors', 'fastapi', "
        "'kopf', 'diloco_sync')])",
    )
    assert found.returncode == 0, found.stderr
    version, *flags = found.stdout.split()
    assert version.startswith("2.9.1")
    assert flags == ["True", "True", "False", "False", "False"]
