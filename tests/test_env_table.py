"""The ARENO_* table (areno.config.env): every variable areno reads is in it, docs/env.md is generated from it, and
`areno env` prints it with the values here."""

import json
import re
from pathlib import Path

import pytest

from areno.config.env import TABLE, env_value, markdown

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bARENO_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_areno_variable_in_the_package_is_in_the_table():
    named = {m for p in (REPO / "areno").rglob("*.py") for m in NAME.findall(p.read_text())}
    assert named - TABLE.keys() == set(), "add these to areno/config/env.py VARIABLES"
    assert TABLE.keys() - named == set(), "in the table but read nowhere: remove them"


def test_docs_env_md_is_generated_from_the_table():
    assert (REPO / "docs" / "env.md").read_text() == markdown(), "regenerate: python -m areno.config.env > docs/env.md"


def test_env_value_reads_only_names_in_the_table(monkeypatch):
    monkeypatch.setenv("ARENO_TRACE_STEPS_MS", "250")
    assert env_value("ARENO_TRACE_STEPS_MS") == "250"
    monkeypatch.delenv("ARENO_TRACE_STEPS_MS")
    assert env_value("ARENO_TRACE_STEPS_MS") is None
    with pytest.raises(KeyError, match="ARENO_NOT_A_VARIABLE"):
        env_value("ARENO_NOT_A_VARIABLE")


def test_areno_env_prints_the_table_with_the_values_here(capsys, monkeypatch):
    from areno.cli import main

    monkeypatch.setenv("ARENO_MLA_CACHE", "latent")
    assert main(["env", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["areno_variables"]}
    assert rows.keys() == TABLE.keys()
    assert rows["ARENO_MLA_CACHE"]["value"] == "latent" and rows["ARENO_MLA_CACHE"]["default"] == "expanded"
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "areno_variables:" in text and "  ARENO_MLA_CACHE: latent (default: expanded): " in text
    assert "  ARENO_TRACE_STEPS_MS: unset (default: unset): " in text
