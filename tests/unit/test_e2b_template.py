"""loopline's E2B template recipe, as the real SDK would send it to E2B (E2B's build service is not reachable
here: the attack suite runs the recipe's script on a template built as E2B builds them, tests/fakes)."""

from __future__ import annotations

import json
import shlex
import subprocess

import e2b

from loopline.envregistry import e2b_template


def test_the_recipe_hardens_as_root_after_e2b_provisions_and_is_ready_only_once_hardened(monkeypatch):
    built = []
    monkeypatch.setattr(e2b.Template, "build", staticmethod(lambda template, name, **kw: built.append((template, name)) or "tpl-1"))
    e2b_template.build("coding-box", "python:3.12-slim")
    (template, name), = built
    sent = json.loads(e2b.Template.to_json(template))
    assert name == "coding-box" and sent["fromImage"] == "python:3.12-slim"
    assert sent["steps"] == [{"type": "USER", "args": ["root"], "force": False}]  # the start command runs as root
    assert sent["startCmd"] == f"sh -c {shlex.quote(e2b_template.HARDEN)}" and sent["readyCmd"] == f"test -f {e2b_template.HARDENED}"


def test_building_without_a_key_says_what_is_needed_in_one_line(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    ran = subprocess.run(["envreg", "e2b-template", "build", "x"], capture_output=True, text=True)
    assert ran.returncode == 1 and ran.stdout == "" and ran.stderr.strip().count("\n") == 0
    assert "E2B_API_KEY" in ran.stderr
