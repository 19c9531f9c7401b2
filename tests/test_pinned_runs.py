"""Pinned benchmark runs (issue 37): a run names the commit it ran, refuses a tree
whose sources differ from it, can run from a clean worktree of a commit, and runs
alone. Real git repositories and real processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.qos_replay import pinned_process
from benchmarks.yardstick_matrix import run_cells
from qosd_harness import changed_paths, clean_worktree, one_at_a_time

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _repo(path: Path) -> Path:
    """A repository with one commit: ``sim/model.py`` and ``docs/notes.md``."""
    (path / "sim").mkdir(parents=True)
    (path / "docs").mkdir()
    (path / "sim" / "model.py").write_text("SPEED = 1\n")
    (path / "docs" / "notes.md").write_text("notes\n")
    _git(path, "init", "-q")
    _git(path, "add", ".")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return path


def test_changed_paths_sees_edits_and_new_files_under_the_sources_only(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    assert changed_paths(repo, ["sim"]) == []
    (repo / "sim" / "model.py").write_text("SPEED = 2\n")
    (repo / "sim" / "new.py").write_text("")
    (repo / "docs" / "notes.md").write_text("results\n")  # not a source
    assert sorted(changed_paths(repo, ["sim"])) == ["sim/model.py", "sim/new.py"]


def test_a_clean_worktree_holds_the_commit_and_goes_away(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "sim" / "model.py").write_text("SPEED = 2\n")
    with clean_worktree(repo, commit) as tree:
        assert (tree / "sim" / "model.py").read_text() == "SPEED = 1\n"
        assert _git(tree, "rev-parse", "HEAD") == commit
    assert not tree.exists()
    assert str(tree) not in _git(repo, "worktree", "list")


def test_a_pinned_runs_processes_import_the_pinned_tree() -> None:
    """The daemons, proxies and servers of a pinned run start as ``python -m``, which
    puts the working directory first on ``sys.path``: they must run the worktree's
    code, not that of the checkout the run was started from."""
    with clean_worktree(ROOT, "HEAD") as tree:
        shown = subprocess.run(
            [sys.executable, "-m", "pydoc", "qosd.cli"],
            **pinned_process(tree), capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert str(tree / "qosd" / "cli.py") in shown, shown[-300:]


def test_a_second_run_waits_for_the_first() -> None:
    name = f"qosd-test-lock-{threading.get_ident()}"
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def hold(entered: threading.Event) -> None:
        with one_at_a_time(name):
            entered.set()
            release.wait(30)

    first = threading.Thread(target=hold, args=(first_in,))
    first.start()
    assert first_in.wait(30)
    second = threading.Thread(target=hold, args=(second_in,))
    second.start()
    assert not second_in.wait(0.3)  # held: the second waits (a bound, not a sync)
    release.set()
    assert second_in.wait(30)
    first.join(30)
    second.join(30)


def test_the_replay_refuses_a_tree_whose_sources_differ(tmp_path: Path) -> None:
    """Only the refusal is run here (it comes before any replay): the script, in a
    repository of its own whose ``sim/`` has an uncommitted edit."""
    repo = _repo(tmp_path / "repo")
    (repo / "benchmarks").mkdir()
    for name in ("__init__.py", "qos_replay.py"):
        shutil.copy(ROOT / "benchmarks" / name, repo / "benchmarks" / name)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "script")
    (repo / "sim" / "model.py").write_text("SPEED = 2\n")
    refused = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "qos_replay.py"),
         "--json", str(tmp_path / "r.json"), "--seeds", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "refusing to run from a tree whose sources differ" in refused.stderr
    assert "sim/model.py" in refused.stderr and "--commit REV" in refused.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_matrix_runs_only_the_cells_not_yet_run_at_its_commit(tmp_path: Path) -> None:
    """``yardstick_matrix --list`` plans the cells to run: one whose results name the
    same commit is kept; one run at another commit, or as a development run, is
    planned again, at the commit asked for."""
    commit = _git(ROOT, "rev-parse", "--short=12", "HEAD")
    cells = {"chunked": commit, "unchunked": "0123456789ab", "chunked-priority": commit}
    for engine, recorded in cells.items():
        development = engine == "chunked-priority"
        results = {"commit": recorded, "development_run": development}
        (tmp_path / f"yardstick_azure_1.5x_{engine}.json").write_text(json.dumps(results))
    planned = subprocess.run(
        [sys.executable, "-m", "benchmarks.yardstick_matrix", "--list", "--out", str(tmp_path),
         "--workloads", "azure", "--loads", "1.5,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert planned[0].startswith(f"6 cells at {commit} (1 done), 10 seeds each")
    commands = planned[1:]
    assert len(commands) == 5 and all(f"--commit {commit}" in c for c in commands)
    assert not any(c.endswith("yardstick_azure_1.5x_chunked.json") for c in commands)
    assert any("--load 1.5 --engine unchunked" in c for c in commands)
    assert any("--load 1.5 --engine chunked-priority" in c for c in commands)


def test_cells_run_side_by_side_each_logging_beside_its_results(tmp_path: Path) -> None:
    """``yardstick_matrix --jobs N`` (virtual time): N cells at once, each one's output
    in ``{cell}.log`` beside its results; one failed cell fails the matrix."""

    def cell(name: str, code: str) -> list[str]:
        return [sys.executable, "-c", code, "--json", str(tmp_path / f"{name}.json")]

    ok = [cell("a", "print('cell a')"), cell("b", "print('cell b')")]
    assert run_cells(ok, jobs=2)
    assert (tmp_path / "a.log").read_text() == "cell a\n"
    assert (tmp_path / "b.log").read_text() == "cell b\n"
    assert not run_cells([*ok, cell("c", "raise SystemExit(3)")], jobs=2)
