"""A linter for the images' Dockerfiles (Dockerfile, worker-image/Dockerfile, worker-image/Dockerfile.cpu).

Rules: every FROM pinned to a tag or digest, never ``latest``; every ``pip install`` names ``package==version``
or installs a local path under a lockfile (``PIP_CONSTRAINT=``/``-c``/``-r``); a non-root USER set before the
ENTRYPOINT; a HEALTHCHECK; the ENTRYPOINT runs ``fulcrum worker`` (worker images) or ``fulcrum`` (control plane).
Also: the lockfile pins every dependency pyproject.toml declares, and .dockerignore keeps the build context small.

Docker is not available on the test machines, so the images are linted, not built. The parser is the small one
below (continuation lines, comments, ARG/ENV substitution, exec-form JSON): ``dockerfile-parse`` is not installed
in the project's environment, and these rules need no more than this.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = {
    "Dockerfile": ["fulcrum"],
    "worker-image/Dockerfile": ["fulcrum", "worker"],
    "worker-image/Dockerfile.cpu": ["fulcrum", "worker"],
}
LOCKFILE = REPO / "worker-image" / "constraints.txt"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "RUN"
    value: str  # the rest, continuation lines joined
    line: int  # 1-based line of the instruction's first line


def parse(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comment lines dropped (also inside continued instructions), ``\\``-continued
    lines joined with a space."""
    out: list[Instruction] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buffer:
            start = number
        continued = stripped.endswith("\\")
        buffer.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, value = " ".join(buffer).partition(" ")
            out.append(Instruction(keyword.upper(), value.strip(), start))
            buffer = []
    assert not buffer, "the Dockerfile ends inside a continued instruction"
    return out


def substitute(text: str, variables: dict[str, str]) -> str:
    """``${VAR}`` and ``$VAR`` replaced by known values (unknown ones left as they are)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def arg_defaults(value: str) -> dict[str, str]:
    name, sep, default = value.partition("=")
    return {name.strip(): default.strip().strip('"')} if sep else {}


def env_values(value: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(value) if "=" in item)


REQUIREMENT_PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9_,.-]+\])?==[A-Za-z0-9.+!_-]+$")
OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "--target", "-t", "--prefix", "--root", "--python", "--platform"}


def lint(text: str, entrypoint: list[str]) -> list[str]:
    """Every rule the text breaks, as messages naming the line (empty when it passes)."""
    problems: list[str] = []
    instructions = parse(text)
    global_args: dict[str, str] = {}
    variables: dict[str, str] = {}
    stages: set[str] = set()
    seen_from = False
    user: str | None = None
    user_line = 0
    entry: tuple[list[str], int] | None = None
    healthcheck = False
    for ins in instructions:
        if ins.keyword == "ARG":
            (global_args if not seen_from else variables).update(arg_defaults(ins.value))
            if seen_from and "=" not in ins.value and ins.value.strip() in global_args:  # re-declared global ARG
                variables[ins.value.strip()] = global_args[ins.value.strip()]
        elif ins.keyword == "FROM":
            seen_from = True
            variables = {}
            user, entry = None, None  # USER and ENTRYPOINT are per stage; the last stage is the image
            words = [w for w in substitute(ins.value, global_args).split() if not w.startswith("--platform")]
            image = words[0]
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image in stages or image == "scratch":
                continue
            if "$" in image:
                problems.append(f"line {ins.line}: FROM {image}: a build argument without a default")
            elif "@sha256:" in image:
                continue
            else:
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                if not tag or tag == "latest":
                    problems.append(f"line {ins.line}: FROM {image} is not pinned to a tag or digest")
        elif ins.keyword == "ENV":
            variables.update(env_values(ins.value))
        elif ins.keyword == "RUN":
            problems += [f"line {ins.line}: {p}" for p in lint_pip(substitute(ins.value, variables))]
        elif ins.keyword == "USER":
            user, user_line = substitute(ins.value, variables), ins.line
        elif ins.keyword == "HEALTHCHECK":
            healthcheck = ins.value.strip().upper() != "NONE"
        elif ins.keyword == "ENTRYPOINT":
            try:
                entry = (json.loads(ins.value), ins.line)
            except ValueError:
                problems.append(f"line {ins.line}: ENTRYPOINT in shell form (signals would not reach fulcrum)")
    if entry is None:
        problems.append("no ENTRYPOINT in the final stage")
    elif entry[0] != entrypoint:
        problems.append(f"ENTRYPOINT is {entry[0]}, not {entrypoint}")
    if user is None or user.split(":")[0] in ("root", "0"):
        problems.append("no non-root USER in the final stage")
    elif entry is not None and user_line > entry[1]:
        problems.append("USER is set after the ENTRYPOINT")
    if not healthcheck:
        problems.append("no HEALTHCHECK")
    return problems


def lint_pip(command: str) -> list[str]:
    """Problems of every ``pip install`` in one RUN command (split at ``&&``, ``||``, ``;``, ``|``)."""
    problems: list[str] = []
    for segment in re.split(r"&&|\|\||;|\|", command):
        words = shlex.split(segment.replace("(", " ").replace(")", " "))
        if "pip" not in words or "install" not in words[words.index("pip"):]:
            continue
        at = words.index("install", words.index("pip"))
        locked = any(w.startswith("PIP_CONSTRAINT=") or w.startswith("PIP_REQUIREMENT=") for w in words[:at])
        requirements: list[str] = []
        rest = iter(words[at + 1:])
        for word in rest:
            if word in OPTIONS_WITH_VALUE:
                next(rest, "")  # the option's value (a file, an index URL, ...)
                locked = locked or word in ("-c", "--constraint", "-r", "--requirement")
            elif word.startswith("-"):
                locked = locked or word.startswith(("--constraint=", "--requirement="))
            else:
                requirements.append(word)
        for req in requirements:
            if req.startswith(("/", "./", ".")):
                if not locked:
                    problems.append(f"pip install {req}: a local package without a lockfile (PIP_CONSTRAINT or -c)")
            elif not REQUIREMENT_PINNED.match(req):
                problems.append(f"pip install {req}: not pinned with ==")
    return problems


@pytest.mark.parametrize(("path", "entrypoint"), sorted(IMAGES.items()))
def test_each_image_pins_its_bases_and_packages_runs_as_non_root_and_checks_health(
    path: str, entrypoint: list[str]
) -> None:
    assert lint((REPO / path).read_text(), entrypoint) == []


def test_the_linter_catches_a_latest_base_unpinned_packages_root_and_no_healthcheck() -> None:
    bad = "\n".join([
        "FROM python:latest",
        "FROM ubuntu AS base",
        "ARG TAG",
        "RUN pip install requests && python -m pip install --no-cache-dir 'numpy>=1' && \\",
        "    # a comment inside a continued RUN",
        "    pip install /src",
        "USER root",
        "ENTRYPOINT fulcrum worker",
    ])
    problems = lint(bad, ["fulcrum", "worker"])
    assert any("python:latest is not pinned" in p for p in problems)
    assert any("FROM ubuntu is not pinned" in p for p in problems)
    assert any("pip install requests: not pinned" in p for p in problems)
    assert any("pip install numpy>=1: not pinned" in p for p in problems)
    assert any("pip install /src: a local package without a lockfile" in p for p in problems)
    assert "no non-root USER in the final stage" in problems
    assert "no HEALTHCHECK" in problems
    assert any("shell form" in p for p in problems)


def test_the_linter_accepts_pins_by_build_argument_digests_and_lockfiles() -> None:
    good = "\n".join([
        "ARG BASE=python:3.11.7-slim-bookworm",
        "FROM ${BASE} AS build",
        "ARG V=1.5.1",
        'RUN pip install "nixl==${V}" && PIP_CONSTRAINT=/c.txt pip install "/src[worker]" && pip install -r /r.txt',
        "FROM busybox@sha256:" + "0" * 64,
        "USER 10001:10001",
        "HEALTHCHECK CMD true",
        'ENTRYPOINT ["fulcrum"]',
    ])
    assert lint(good, ["fulcrum"]) == []


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]).lower()


def test_the_lockfile_pins_every_dependency_pyproject_declares() -> None:
    lines = [ln.strip() for ln in LOCKFILE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(REQUIREMENT_PINNED.match(ln) for ln in lines), [ln for ln in lines if not REQUIREMENT_PINNED.match(ln)]
    locked = {_name(ln) for ln in lines}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = list(project["project"]["dependencies"]) + list(project["build-system"]["requires"])
    for extra in ("router", "operator", "worker"):
        wanted += project["project"]["optional-dependencies"][extra]
    missing = {_name(r) for r in wanted if _name(r) != "fulcrum"} - locked
    assert not missing, f"worker-image/constraints.txt lacks {sorted(missing)}"


def test_the_build_context_leaves_out_environments_and_history_but_keeps_what_pip_needs() -> None:
    patterns = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv-*", "**/__pycache__", "tests"} <= patterns
    for needed in ("pyproject.toml", "README.md", "src", "router", "routing", "operator", "worker", "simulator",
                   "worker-image", "worker-image/constraints.txt"):
        assert needed not in patterns
