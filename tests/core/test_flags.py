"""The one loader: flags and DILOCO_* variables derived from typed settings, read back, and errors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Literal

import pytest
from diloco_core.config import DiLoCoSettings, ModelSettings
from diloco_core.flags import (
    Cli,
    SettingsError,
    add_flags,
    derive_flags,
    read,
    read_document,
    to_argv,
    to_env,
    unknown_variables,
    validate,
)
from diloco_core.validation_errors import describe_errors
from pydantic import BaseModel, ConfigDict, Field, SecretStr


class Demo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("demo", description="what it is called")
    wait_s: Annotated[float, Cli("wait", short="-w")] = Field(1.0, gt=0.0, description="seconds to wait")
    secret: SecretStr | None = Field(None, description="a secret")
    token: Annotated[str | None, Cli(secret=True)] = None
    urls: tuple[str, ...] = ()
    verbose: bool = False
    weighted: bool = True
    color: Literal["red", "blue"] = "red"
    diloco: DiLoCoSettings = DiLoCoSettings(inner_steps=16)
    model: ModelSettings = ModelSettings()


FLAGS = derive_flags(Demo, {"": None, "diloco": ("inner_steps", "overlap"), "model": ("n_layer",)})


def load(argv: list[str], env: dict[str, str] | None = None, base: dict[str, object] | None = None) -> Demo:
    parser = argparse.ArgumentParser()
    add_flags(parser, FLAGS)
    given = read(FLAGS, parser.parse_args(argv), env or {})
    return validate(Demo, given, base=base, base_source="--job-config")


def test_flags_and_variables_are_named_after_the_fields() -> None:
    by_name = {f.name: f for f in FLAGS}
    assert list(by_name) == [
        "name", "wait", "secret", "token", "urls", "verbose", "weighted", "color", "inner-steps", "overlap", "n-layer",
    ]  # fmt: skip
    assert by_name["inner-steps"].path == ("diloco", "inner_steps")
    assert (by_name["wait"].env, by_name["wait"].short) == ("DILOCO_WAIT", "-w")
    assert [f.name for f in FLAGS if f.secret] == ["secret", "token"]
    # the help is the field's description with the default the model declares for it
    assert by_name["inner-steps"].help.endswith("(default 16)")
    assert "one of red, blue" in by_name["color"].help


def test_two_fields_may_not_share_a_flag() -> None:
    class Clash(BaseModel):
        seed: int = 0
        model: ModelSettings = ModelSettings()

    with pytest.raises(ValueError, match="seed"):
        derive_flags(Clash, {"": None, "model": None})


def test_a_flag_wins_over_its_variable_which_wins_over_the_base_and_the_defaults() -> None:
    base = {"name": "from-base", "diloco": {"overlap": 1, "quorum": 3}}
    env = {"DILOCO_NAME": "from-env", "DILOCO_INNER_STEPS": "8"}
    s = load(["--inner-steps", "12"], env, base)
    assert (s.name, s.diloco.inner_steps, s.diloco.overlap, s.diloco.quorum) == ("from-env", 12, 1, 3)
    assert load([], {}, base).name == "from-base"
    # a section's declared default stays for the fields nobody set
    assert load(["--overlap", "3"]).diloco.inner_steps == 16


def test_booleans_lists_and_empty_variables() -> None:
    assert load(["--verbose", "--no-weighted"]).verbose is True
    assert load(["--no-weighted"]).weighted is False
    assert load([], {"DILOCO_VERBOSE": "yes", "DILOCO_NO_WEIGHTED": "1"}).model_dump(include={"verbose", "weighted"}) == {
        "verbose": True, "weighted": False}  # fmt: skip
    assert load([], {"DILOCO_WEIGHTED": "0"}).weighted is False
    assert load(["--urls", "a,b", "--urls", "c"]).urls == ("a", "b", "c")
    assert load([], {"DILOCO_URLS": "a, b"}).urls == ("a", "b")
    assert load([], {"DILOCO_NAME": ""}).name == "demo"  # empty counts as unset
    with pytest.raises(SettingsError, match="DILOCO_NO_WEIGHTED='maybe'"):
        load([], {"DILOCO_NO_WEIGHTED": "maybe"})


def test_errors_name_the_setting_and_where_its_value_came_from() -> None:
    with pytest.raises(SettingsError, match=r"wait_s \(-?-wait=0\): Input should be greater than 0"):
        load(["--wait", "0"])
    with pytest.raises(SettingsError, match=r"verbose \(DILOCO_VERBOSE='maybe'\)"):
        load([], {"DILOCO_VERBOSE": "maybe"})
    with pytest.raises(
        SettingsError, match=r"diloco \(given: --inner-steps=2, --overlap=2\): overlap \(2\) must be"
    ):
        load(["--inner-steps", "2", "--overlap", "2"])
    with pytest.raises(SettingsError, match=r"diloco.quorum \(from --job-config\)"):
        load([], {}, {"diloco": {"quorum": 0}})
    with pytest.raises(SettingsError, match=r"color \(--color=green\): Input should be 'red' or 'blue'"):
        load(["--color", "green"])


def test_secret_values_never_appear_in_messages() -> None:
    class Strict(BaseModel):
        secret: Annotated[SecretStr, Field(min_length=30)]
        token: Annotated[str, Cli(secret=True), Field(min_length=30)]

    flags = derive_flags(Strict, {"": None})
    args = argparse.Namespace(secret="hunter2", token=None)
    with pytest.raises(SettingsError) as caught:
        validate(Strict, read(flags, args, {"DILOCO_TOKEN": "swordfish"}))
    message = str(caught.value)
    assert ("--secret" in message, "DILOCO_TOKEN" in message) == (True, True)
    assert ("hunter2" in message, "swordfish" in message) == (False, False)


def test_settings_go_back_to_flags_and_variables_unchanged() -> None:
    s = load(
        ["--name", "x", "--urls", "a,b", "--verbose", "--no-weighted", "--inner-steps", "9", "--n-layer", "2"]
    )
    again = load(to_argv(FLAGS, s))
    assert again == s.model_copy(update={"secret": None, "token": None})
    assert load([], to_env(FLAGS, s)) == s
    assert "--secret" not in to_argv(FLAGS, load(["--secret", "s3cret"]))


def test_unknown_variables_are_found() -> None:
    env = {"DILOCO_NAME": "a", "DILOCO_NAMES": "b", "DILOCO_NO_VERBOSE": "1", "OTHER": "c"}
    assert unknown_variables(FLAGS, env, "DILOCO_") == ["DILOCO_NAMES"]


def test_describe_errors_is_the_one_rendering() -> None:
    errors = [{"loc": ("body", "plan"), "msg": "Field required"}, {"loc": (), "msg": "Value error, no URL"}]
    assert describe_errors(errors) == "body.plan: Field required; no URL"
    assert describe_errors(errors, lambda loc: "spec." + ".".join(map(str, loc))) == (
        "spec.body.plan: Field required; spec.: no URL"
    )


def test_documents_from_json_text_or_a_json_or_yaml_file(tmp_path: Path) -> None:
    assert read_document('{"a": 1}', "x") == {"a": 1}
    (tmp_path / "c.yaml").write_text("a: 2\n")
    (tmp_path / "c.json").write_text('{"a": 3}')
    assert read_document(str(tmp_path / "c.yaml"), "x") == {"a": 2}
    assert read_document("@" + str(tmp_path / "c.json"), "x") == {"a": 3}
    with pytest.raises(SettingsError, match="cannot read --job-config"):
        read_document(str(tmp_path / "missing.yaml"), "--job-config")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SettingsError, match="must be a mapping"):
        read_document(str(tmp_path / "list.yaml"), "x")


def test_more_fragments_than_inner_steps_are_refused_in_the_settings() -> None:
    with pytest.raises(ValueError, match=r"fragments \(4\) must be at most inner_steps \(2\)"):
        DiLoCoSettings(fragments=4, inner_steps=2, overlap=1)
    assert DiLoCoSettings(fragments=4, inner_steps=4, overlap=1).fragments == 4
