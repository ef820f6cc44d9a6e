"""A small, strict reader of Dockerfiles and .dockerignore files, for checks without a Docker engine.

It follows the Dockerfile reference: parser directives, comments, backslash line continuations,
JSON ("exec") and shell forms, `FROM image AS name` stages and `COPY --from=stage`. It raises
`DockerfileError` with the line number for what BuildKit would reject.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

INSTRUCTIONS = frozenset(
    {
        "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
        "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
    }
)  # fmt: skip
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$")
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[-+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    arguments: str

    def exec_form(self) -> list[str] | None:
        """The JSON array form of the arguments, or None when they are in shell form."""
        text = self.arguments.strip()
        if not text.startswith("["):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DockerfileError(f"line {self.line}: {self.keyword} has malformed JSON: {exc}") from exc
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise DockerfileError(f"line {self.line}: {self.keyword} JSON form must be a list of strings")
        return value


@dataclass
class Stage:
    index: int
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    directives: dict[str, str]
    global_args: dict[str, str | None]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for s in self.stages for i in s.instructions if i.keyword == keyword]


def _logical_lines(text: str) -> tuple[dict[str, str], list[tuple[int, str]]]:
    """Parser directives, then (first line number, joined text) of every instruction."""
    directives: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines) and (m := _DIRECTIVE.match(lines[i])):
        directives[m.group(1).lower()] = m.group(2)
        i += 1
    out: list[tuple[int, str]] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(lines[i:], start=i + 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue  # comments may sit inside a continued instruction
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1])
            continue
        buffer.append(stripped)
        out.append((start, " ".join(part for part in buffer if part)))
        buffer = []
    if buffer:
        raise DockerfileError(f"line {start}: the file ends inside a continued instruction")
    return directives, out


def parse(text: str) -> Dockerfile:
    directives, lines = _logical_lines(text)
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for number, content in lines:
        keyword, _, arguments = content.partition(" ")
        keyword = keyword.upper()
        if keyword not in INSTRUCTIONS:
            raise DockerfileError(f"line {number}: unknown instruction {keyword!r}")
        if not arguments.strip():
            raise DockerfileError(f"line {number}: {keyword} needs arguments")
        instruction = Instruction(number, keyword, arguments.strip())
        if keyword == "FROM":
            stages.append(_parse_from(instruction, len(stages), stages))
        elif not stages:
            if keyword != "ARG":
                raise DockerfileError(
                    f"line {number}: only ARG may come before the first FROM, not {keyword}"
                )
            name, _, default = arguments.strip().partition("=")
            # a default may name the ARGs declared before it
            known = {k: v for k, v in global_args.items() if v is not None}
            global_args[name] = substitute(default, known) if default else None
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise DockerfileError("no FROM instruction")
    dockerfile = Dockerfile(directives, global_args, stages)
    _check_references(dockerfile)
    return dockerfile


def _parse_from(instruction: Instruction, index: int, earlier: list[Stage]) -> Stage:
    words = [w for w in instruction.arguments.split() if not w.startswith("--platform=")]
    if len(words) == 3 and words[1].upper() == "AS":
        name = words[2]
        if not _STAGE_NAME.match(name):
            raise DockerfileError(f"line {instruction.line}: invalid stage name {name!r}")
        if any(s.name == name for s in earlier):
            raise DockerfileError(f"line {instruction.line}: stage name {name!r} is used twice")
        return Stage(index, words[0], name)
    if len(words) == 1:
        return Stage(index, words[0], None)
    raise DockerfileError(
        f"line {instruction.line}: expected 'FROM image [AS name]', got {instruction.arguments!r}"
    )


def _check_references(dockerfile: Dockerfile) -> None:
    """Every variable in a FROM is a declared global ARG; every COPY --from names an earlier stage."""
    for stage in dockerfile.stages:
        for m in _VAR.finditer(stage.base):
            var = m.group(1) or m.group(2)
            if var not in dockerfile.global_args:
                raise DockerfileError(
                    f"stage {stage.index}: FROM uses ${var}, which no ARG before FROM declares"
                )
        earlier = {s.name for s in dockerfile.stages[: stage.index]} | {str(i) for i in range(stage.index)}
        for instruction in stage.instructions:
            if instruction.keyword in ("COPY", "ADD"):
                source = copy_flags(instruction).get("from")
                if source is not None and source not in earlier and ":" not in source and "/" not in source:
                    raise DockerfileError(
                        f"line {instruction.line}: COPY --from={source} names no earlier stage"
                    )


def copy_flags(instruction: Instruction) -> dict[str, str]:
    flags: dict[str, str] = {}
    for word in shlex.split(instruction.arguments):
        if not word.startswith("--"):
            break
        key, _, value = word[2:].partition("=")
        flags[key] = value
    return flags


def copy_paths(instruction: Instruction) -> tuple[list[str], str]:
    """(sources, destination) of a COPY or ADD, in either form."""
    words = instruction.exec_form()
    if words is None:
        words = shlex.split(instruction.arguments)
    words = [w for w in words if not w.startswith("--")]
    if len(words) < 2:
        raise DockerfileError(
            f"line {instruction.line}: {instruction.keyword} needs a source and a destination"
        )
    return words[:-1], words[-1]


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace $VAR and ${VAR} (with :- defaults) the way the Dockerfile frontend does."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in values:
            return values[name]
        default = re.match(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", m.group(0))
        return default.group(1) if default else ""

    return _VAR.sub(one, text)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression (moby's patternmatcher rules)."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if i < len(pattern) and pattern[i] == "/":
                out = out[:-2] + "(.*/)?"
                i += 1
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
        i += 1
    return re.compile(f"^{out}$")


def dockerignore_excludes(dockerignore: str, path: str) -> bool:
    """Whether `path` (relative to the context) is left out of the build context."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for raw in dockerignore.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        cleaned = str(Path(line[1:] if negate else line)).lstrip("/")
        rules.append((negate, _pattern_regex(cleaned)))
    parts = Path(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negate, regex in rules:
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def shell_commands(instruction: Instruction) -> list[list[str]]:
    """The simple commands of a shell-form RUN, split at `&&`, `||` and `;`, each as its words."""
    if instruction.exec_form() is not None:
        return [instruction.exec_form() or []]
    lexer = shlex.shlex(instruction.arguments, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";"):
            commands.append([])
        elif set(word) <= set(";&|"):
            raise DockerfileError(f"line {instruction.line}: unsupported shell operator {word!r} in RUN")
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


@dataclass(frozen=True)
class PipInstall:
    """One `pip install` of a RUN: its options (each with its value, if any) and its targets."""

    line: int
    options: list[tuple[str, str | None]]
    targets: list[str]

    def values(self, *names: str) -> list[str]:
        return [value for option, value in self.options if option in names and value is not None]


# pip install options that take a value (the ones a Dockerfile is likely to use)
_PIP_VALUED = frozenset(
    {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f",
     "--find-links", "-t", "--target", "--prefix", "--root", "--build-constraint", "--only-binary",
     "--no-binary", "--platform", "--python-version", "--report", "--cache-dir", "--progress-bar"}
)  # fmt: skip


def pip_installs(instruction: Instruction) -> list[PipInstall]:
    """Every `pip install` (`pip`, `pip3` or `<python> -m pip`) among a RUN's commands."""
    out: list[PipInstall] = []
    for words in shell_commands(instruction):
        for i in range(len(words) - 1):
            if Path(words[i]).name in ("pip", "pip3") and words[i + 1] == "install":
                out.append(_pip_install(instruction.line, words[i + 2 :]))
                break
    return out


def _pip_install(line: int, words: list[str]) -> PipInstall:
    options: list[tuple[str, str | None]] = []
    targets: list[str] = []
    it = iter(words)
    for word in it:
        if not word.startswith("-"):
            targets.append(word)
        elif word.startswith("--") and "=" in word:
            name, _, value = word.partition("=")
            options.append((name, value))
        elif word in _PIP_VALUED:
            value = next(it, None)
            if value is None:
                raise DockerfileError(f"line {line}: pip install {word} needs a value")
            options.append((word, value))
        else:
            options.append((word, None))
    return PipInstall(line, options, targets)
