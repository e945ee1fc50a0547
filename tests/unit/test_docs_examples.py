"""The docs' command examples run as written and show what they print.

Cheap checks only (no whole-trace replay): the quickstart's ``--compare`` output is the README's (the same
command), every comparison table in the docs has the columns ``fulcrum replay`` prints, every ``fulcrum replay``
command of the docs passes the command's own flag checks, and the operations guide's ``fulcrum profile`` command
gets past the checks that stop a run before measuring.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from fulcrum.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
QUICKSTART = REPO / "docs" / "quickstart.md"
REPLAY_DOC = REPO / "docs" / "replay.md"
OPERATIONS = REPO / "docs" / "operations.md"
TABLE_DOCS = (README, QUICKSTART, REPLAY_DOC)


def code_blocks(path: Path, lang: str | None = None) -> list[str]:
    """The fenced code blocks of ``path`` (only those opened with ``lang`` when given)."""
    blocks = re.findall(r"^ *```([a-z]*)\n(.*?)^ *```", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return [body for tag, body in blocks if lang is None or tag == lang]


def commands(path: Path, prefix: str) -> list[list[str]]:
    """Every command of the ``bash`` blocks of ``path`` starting with ``prefix`` (continuations joined), split."""
    out = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            for part in line.split("&&"):
                if part.strip().startswith(prefix):
                    out.append(shlex.split(part))
    return out


def compare_output(path: Path) -> list[str]:
    """The lines of the first code block of ``path`` holding the comparison table of ``--compare``."""
    block = next(b for b in code_blocks(path) if "\nstatic-best " in b and "Pareto: " in b)
    return block.splitlines()


def columns(header: str) -> list[str]:
    return re.split(r"\s{2,}", header.strip())


def test_the_quickstart_shows_the_same_compare_output_as_the_readme() -> None:
    # the same command in both; wall times differ from run to run, every number else must not
    quick, readme = compare_output(QUICKSTART), compare_output(README)

    def stable(lines: list[str]) -> list[str]:
        # the README leaves out the per-policy progress lines (they carry wall times) and the table's title
        rows = [x for x in lines if x and not x.startswith(("  ", "Replay of trace "))]
        return [x.rsplit(None, 1)[0] if re.match(r"^[a-z][a-z-]* +\d", x) else x for x in rows]

    assert stable(quick) == stable(readme)
    assert any(x.startswith("Pareto: fulcrum (98.6% / 3.70 GPU-h)") for x in quick)


def test_the_quickstart_prose_quotes_its_own_table() -> None:
    text = QUICKSTART.read_text(encoding="utf-8")
    assert "14% more GPU-hours" not in text  # the stale reading of an older table
    rows = {x.split()[0]: x.split() for x in compare_output(QUICKSTART) if re.match(r"^(fulcrum|dopd) ", x)}
    for policy in ("fulcrum", "dopd"):
        slo, gpu_h = rows[policy][1], rows[policy][6]
        assert f"{slo}%" in text and gpu_h in text, policy


@pytest.fixture(scope="module")
def printed_header() -> list[str]:
    """The columns of the comparison table a short replay prints."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["replay", "--trace", "azure-conv-2023", "--duration", "300", "--warmup", "0", "--policy",
                     "static", "--no-progress"]) == 0
    header = next(x for x in buf.getvalue().splitlines() if x.startswith("policy ") and "SLO %" in x)
    return columns(header)


@pytest.mark.parametrize("doc", TABLE_DOCS, ids=lambda p: p.name)
def test_every_comparison_table_of_the_docs_has_the_printed_columns(doc: Path, printed_header: list[str]) -> None:
    headers = [x for b in code_blocks(doc) for x in b.splitlines() if x.startswith("policy ") and "SLO %" in x]
    assert headers, doc
    for header in headers:
        assert columns(header) == printed_header, header  # e.g. no `paths` column: paths are on the policy lines


@pytest.mark.parametrize("doc", [README, QUICKSTART, REPLAY_DOC, OPERATIONS], ids=lambda p: p.name)
def test_every_replay_command_of_the_docs_passes_the_commands_flag_checks(doc: Path) -> None:
    from fulcrum.commands.replay import _check_flags

    parser = build_parser()
    for argv in commands(doc, "fulcrum replay"):
        args = parser.parse_args(argv[1:])
        _check_flags(args)  # e.g. --compare with several --routing names: an error since it dropped --compare


def test_the_routing_comparison_commands_are_shown_with_what_they_print() -> None:
    replays = [a for a in commands(REPLAY_DOC, "fulcrum replay") if "--routing" in a]
    assert len(replays) == 3
    text = REPLAY_DOC.read_text(encoding="utf-8")
    for argv in replays:
        routing = argv[argv.index("--routing") + 1].split(",")
        planner = argv[argv.index("--policy") + 1] if "--policy" in argv else "fulcrum"
        assert f"planner {planner}; routing policies compared: {', '.join(routing)}" in text, argv


class _Measured(Exception):
    """Raised in place of measuring: the command got past every check that runs before it."""


def test_the_operations_guides_profile_command_gets_past_the_checks_before_measuring(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fulcrum.commands.profile as profile_cmd

    (argv,) = commands(OPERATIONS, "fulcrum profile")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    subs = {"http://<engine>:8000": "http://127.0.0.1:9", "<served-name>": "m", "/models/<model>": str(model_dir)}
    argv = [subs.get(a, a) for a in argv]
    assert not any("<" in a for a in argv), argv
    monkeypatch.chdir(tmp_path)  # --out and --configmap-out are relative names

    def fake_measure(*_: Any, **__: Any) -> Any:
        raise _Measured

    monkeypatch.setattr(profile_cmd, "model_dir_facts", lambda *_: object())
    monkeypatch.setattr(profile_cmd, "measure", fake_measure)
    with pytest.raises(_Measured):
        main(argv[1:])
    assert "error" not in capsys.readouterr().err
