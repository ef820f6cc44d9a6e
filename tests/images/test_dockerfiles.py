"""The two images, checked without a Docker engine: syntax, build context, entrypoints, install step."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from itertools import chain
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diloco.cli import SUBCOMMANDS
from tests.images.dockerfile import (
    Dockerfile,
    DockerfileError,
    Instruction,
    PipInstall,
    Stage,
    copy_flags,
    copy_paths,
    dockerignore_excludes,
    parse,
    pip_installs,
    substitute,
)

ROOT = Path(__file__).resolve().parents[2]
# image file, extras it installs, subcommand of its entrypoint, source folders it must not carry
IMAGES = {
    "Dockerfile.sync": ("sync,operator", "synchronizer", {"worker", "bench"}),
    "Dockerfile.worker": ("worker,data", "worker", {"synchronizer", "operator", "bench"}),
}
# the constraints file each image's install step is held to
CONSTRAINTS = {"Dockerfile.sync": "constraints/sync.txt", "Dockerfile.worker": "constraints/worker.txt"}
OCI_LABELS = ("title", "description", "version", "revision", "created", "licenses", "source")


def _read(name: str) -> Dockerfile:
    return parse((ROOT / name).read_text())


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _env_of(stage_instructions: list[Instruction]) -> dict[str, str]:
    """What a RUN of the stage sees in its environment: ENV values and ARG defaults."""
    env: dict[str, str] = {}
    for instruction in stage_instructions:
        if instruction.keyword == "ARG":
            key, _, value = instruction.arguments.partition("=")
            env[key] = value
        if instruction.keyword == "ENV":
            for word in shlex.split(instruction.arguments):
                key, _, value = word.partition("=")
                env[key] = value
    return env


@pytest.fixture(params=sorted(IMAGES))
def image(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _install_step(image: str) -> PipInstall:
    """The build stage's one `pip install` of the project."""
    stage = _read(image).stage("build")
    args = _env_of(stage.instructions)  # the stage's ARG defaults: what a build without --build-arg gets
    installs = [
        p
        for i in stage.instructions
        if i.keyword == "RUN"
        for p in pip_installs(Instruction(i.line, i.keyword, substitute(i.arguments, args)))
    ]
    project = [p for p in installs if any(t.startswith(".[") for t in p.targets)]
    assert len(project) == 1, installs
    return project[0]


def _pins(path: Path) -> dict[str, tuple[str, str]]:
    """A constraints file as {canonical name: (name as written, version)}; every line an exact pin."""
    pins: dict[str, tuple[str, str]] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        assert m, f"{path.name} line {number}: {raw!r} is not an exact name==version pin"
        key = canonicalize_name(m.group(1))
        assert key not in pins, f"{path.name} line {number}: {m.group(1)} is pinned twice"
        pins[key] = (m.group(1), m.group(2))
    return pins


def _image_requirements(extras: str) -> list[Requirement]:
    project = _pyproject()["project"]
    optional = project["optional-dependencies"]
    return [
        Requirement(r) for r in project["dependencies"] + [r for e in extras.split(",") for r in optional[e]]
    ]


def _closure(roots: list[Requirement]) -> tuple[set[str], set[str]]:
    """The distributions pip installs for `roots` here, read from the installed packages' metadata,
    and the ones it would install only on another platform or Python (a marker false here)."""
    needed: set[str] = set()
    elsewhere: set[str] = set()
    todo: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset({""})) for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement, parent_extras = todo.pop()
        name = canonicalize_name(requirement.name)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in parent_extras):
            if "extra" not in str(marker):
                elsewhere.add(name)
            continue
        extras = frozenset({"", *requirement.extras})
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        needed.add(name)
        requires = importlib.metadata.distribution(requirement.name).requires or []
        todo.extend((Requirement(r), extras) for r in requires)
    return needed, elsewhere - needed


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
        assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base


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


def test_parser_finds_the_pip_installs_of_a_run_and_their_options() -> None:
    run = (
        parse(
            "FROM python:3.11-slim\n"
            "RUN python -m venv /v && /v/bin/python -m pip install pip==26.3 \\\n"
            " && /v/bin/pip install --no-cache-dir -c c.txt --constraint=d.txt '.[a,b]'; echo done\n"
        )
        .stages[0]
        .instructions[0]
    )
    first, second = pip_installs(run)
    assert first.targets == ["pip==26.3"]
    assert second.targets == [".[a,b]"]
    assert second.values("-c", "--constraint") == ["c.txt", "d.txt"]
    assert ("--no-cache-dir", None) in second.options
    with pytest.raises(DockerfileError, match="unsupported shell operator"):
        pip_installs(parse("FROM python:3.11-slim\nRUN pip install a | tee log\n").stages[0].instructions[0])


def test_install_step_installs_the_image_extras_and_the_sync_image_gets_no_torch(image: str) -> None:
    extras, _, _ = IMAGES[image]
    install = _install_step(image)
    assert install.targets == [f".[{extras}]"]
    assert ("--no-cache-dir", None) in install.options
    optional = _pyproject()["project"]["optional-dependencies"]
    requirements = [r for extra in extras.split(",") for r in optional[extra]] + _pyproject()["project"][
        "dependencies"
    ]
    has_torch = any(re.match(r"torch\b", r) for r in requirements)
    assert has_torch == (image == "Dockerfile.worker")


def _copied_files(stage: Stage, before_line: int) -> dict[PurePosixPath, Path]:
    """Where each file of the build context lands in the image (absolute paths), for the COPY
    instructions of `stage` above `before_line`, following the WORKDIR in force at each."""
    workdir = PurePosixPath("/")
    placed: dict[PurePosixPath, Path] = {}
    for instruction in stage.instructions:
        if instruction.line >= before_line:
            break
        if instruction.keyword == "WORKDIR":
            workdir = workdir / instruction.arguments
        if instruction.keyword != "COPY" or "from" in copy_flags(instruction):
            continue
        sources, destination = copy_paths(instruction)
        target = workdir / destination
        into_folder = destination.endswith("/") or len(sources) > 1
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                for file in sorted(p for p in src.rglob("*") if p.is_file()):
                    placed[target / file.relative_to(src).as_posix()] = file
            else:
                placed[target / src.name if into_folder else target] = src
    return placed


def _workdir(stage: Stage, before_line: int) -> PurePosixPath:
    workdir = PurePosixPath("/")
    for instruction in stage.instructions:
        if instruction.keyword == "WORKDIR" and instruction.line < before_line:
            workdir = workdir / instruction.arguments
    return workdir


def test_install_step_is_held_to_the_image_constraints_file_copied_before_it(image: str) -> None:
    install = _install_step(image)
    stage = _read(image).stage("build")
    constraints = install.values("-c", "--constraint")
    assert constraints == [CONSTRAINTS[image]], "one constraints file, the image's own"
    in_image = _workdir(stage, install.line) / constraints[0]
    copied = _copied_files(stage, install.line)
    assert in_image in copied, f"{image}: {constraints[0]} is not copied before line {install.line}"
    assert copied[in_image] == ROOT / CONSTRAINTS[image]
    # pip itself, installed before the project, is pinned on its own line
    pips = [
        p for i in stage.instructions if i.keyword == "RUN" for p in pip_installs(i) if p.line != install.line
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", t) for p in pips for t in p.targets), pips


def test_constraints_pin_every_distribution_the_image_installs_and_nothing_else(image: str) -> None:
    """The closure is read from this environment's installed metadata (no index); a distribution
    that a marker brings in only elsewhere (another platform or Python) may be pinned too."""
    extras, _, _ = IMAGES[image]
    pins = _pins(ROOT / CONSTRAINTS[image])
    needed, elsewhere = _closure(_image_requirements(extras))
    needed.discard(canonicalize_name(_pyproject()["project"]["name"]))
    assert needed - pins.keys() == set(), f"{CONSTRAINTS[image]} leaves these unpinned"
    assert pins.keys() - needed - elsewhere == set(), f"{CONSTRAINTS[image]} pins what {image} never installs"


def test_constraint_pins_satisfy_pyproject_and_agree_with_its_exact_pins(image: str) -> None:
    extras, _, _ = IMAGES[image]
    pins = _pins(ROOT / CONSTRAINTS[image])
    for requirement in _image_requirements(extras):
        _, version = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(
            version, prereleases=True
        ), f"{CONSTRAINTS[image]} pins {requirement.name}=={version}, outside pyproject's {requirement}"


def test_pyproject_exact_pins_are_the_constraint_pins_in_both_images() -> None:
    """torch, kopf and zstandard are pinned in pyproject.toml too: the two must never drift apart."""
    project = _pyproject()["project"]
    exact = {
        canonicalize_name(r.name): next(iter(r.specifier)).version
        for r in map(
            Requirement, [*project["dependencies"], *chain(*project["optional-dependencies"].values())]
        )
        if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="
    }
    assert {"torch", "kopf", "zstandard"} <= exact.keys()
    checked = 0
    for path in CONSTRAINTS.values():
        for key, (name, version) in _pins(ROOT / path).items():
            if key in exact:
                assert version == exact[key], f"{path} pins {name}=={version}, pyproject.toml {exact[key]}"
                checked += 1
    assert checked >= 4  # zstandard in both, torch in the worker's, kopf in the synchronizer's


def test_image_names_agree_across_dockerfiles_examples_chart_and_docs() -> None:
    """The OCI title of each Dockerfile is the repository name every example, the chart's default
    and docs/images.md use."""

    def title(image: str) -> str:
        labels = " ".join(
            i.arguments for i in _read(image).stage("runtime").instructions if i.keyword == "LABEL"
        )
        m = re.search(r'org\.opencontainers\.image\.title="([^"]+)"', labels)
        assert m, image
        return m.group(1)

    names = {"worker": title("Dockerfile.worker"), "synchronizer": title("Dockerfile.sync")}
    assert names == {"worker": "diloco-worker", "synchronizer": "diloco-sync"}
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    seen = 0
    for example in examples:
        for document in yaml.safe_load_all(example.read_text()):
            images = (document or {}).get("spec", {}).get("images") or {}
            for role, reference in images.items():
                if role in names:
                    repository = (
                        reference.rsplit(":", 1)[0] if "@" not in reference else reference.split("@")[0]
                    )
                    assert repository.rsplit("/", 1)[-1] == names[role], f"{example.name}: {role} {reference}"
                    seen += 1
    assert seen >= 2
    values = yaml.safe_load((ROOT / "charts" / "diloco" / "values.yaml").read_text())
    assert values["image"]["repository"].rsplit("/", 1)[-1] == names["synchronizer"]
    docs = (ROOT / "docs" / "images.md").read_text()
    for image, name in (("Dockerfile.worker", names["worker"]), ("Dockerfile.sync", names["synchronizer"])):
        assert f"| `{name}` | `{image}` |" in docs
        header = (ROOT / image).read_text().split("\nARG", 1)[0]
        assert re.search(rf"-t \S+/{name}:", header), f"{image}'s header builds another name"


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
    from diloco_operator.builders import env as operator_env
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
    from diloco_operator.builders import env as operator_env

    runtime = _read("Dockerfile.worker").stage("runtime")
    assert [i.arguments for i in runtime.instructions if i.keyword == "EXPOSE"] == [
        str(operator_env.HEALTH_PORT)
    ]


@pytest.fixture
def replay_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder for a replayed build stage, removed after the test whatever its outcome: the worker's
    environment holds PyTorch with its CUDA libraries (several GB), and pytest keeps a test's tmp_path
    until the session's end, when later tests may need the disk."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def _replay_build_stage(image: str, tmp_path: Path, *, reuse_pip_cache: bool) -> Path:
    """Run the build stage's COPY and RUN steps here: the context is a copy of exactly what the
    Dockerfile copies, laid out as in the image under its WORKDIR, and /opt/diloco becomes a folder
    under tmp_path. Returns the virtual environment."""
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
    skipped = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
    context.mkdir()
    copied: set[PurePosixPath] = set()
    for instruction in stage.instructions:
        if instruction.keyword == "COPY":
            workdir = _workdir(stage, instruction.line)
            for in_image, src in _copied_files(stage, instruction.line + 1).items():
                if in_image in copied:
                    continue
                copied.add(in_image)
                if (
                    skipped & set(src.parts)
                    or src.suffix == ".pyc"
                    or any(p.endswith(".egg-info") for p in src.parts)
                ):
                    continue
                assert in_image.is_relative_to(workdir), f"{image}: the replay copies only under WORKDIR"
                target = context / in_image.relative_to(workdir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
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


def _assert_installed_as_pinned(image: str, venv: Path) -> None:
    """Every distribution in the replayed environment is at its pinned version, apart from the
    project itself, pip (pinned in the Dockerfile) and the setuptools that `python -m venv` seeds on
    Python 3.11; on Linux x86-64, the platform the files are resolved for, every pin is installed."""
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(listed.stdout)}
    pins = {key: version for key, (_, version) in _pins(ROOT / CONSTRAINTS[image]).items()}
    for key in (canonicalize_name(_pyproject()["project"]["name"]), "pip", "setuptools"):
        if key not in pins:
            installed.pop(key, None)
    assert {k: v for k, v in installed.items() if pins.get(k) != v} == {}, "installed apart from the pins"
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert installed == pins


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
def test_sync_image_install_step_works_in_a_clean_venv(replay_dir: Path) -> None:
    venv = _replay_build_stage("Dockerfile.sync", replay_dir, reuse_pip_cache=False)
    _assert_installed_as_pinned("Dockerfile.sync", venv)
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
def test_worker_image_install_step_works_in_a_clean_venv(replay_dir: Path) -> None:
    venv = _replay_build_stage("Dockerfile.worker", replay_dir, reuse_pip_cache=True)
    _assert_installed_as_pinned("Dockerfile.worker", venv)
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
