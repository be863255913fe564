"""The environment block every benchmark JSON carries: which commit produced the figures."""

from __future__ import annotations

import subprocess

from tinyvllm.bench.report import environment


def test_environment_names_the_commit_given_by_the_caller(monkeypatch):
    """A copy of the tree on the GPU machine may hold a stale .git: the caller's commit wins."""
    monkeypatch.setenv("TINYVLLM_GIT_COMMIT", "abc1234")
    assert environment()["git"] == "abc1234"


def test_environment_reads_the_checkout_otherwise(monkeypatch):
    monkeypatch.delenv("TINYVLLM_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert environment()["git"] == (head or None)
