"""Argo CD's health check for InferenceDeployment, run by a real Lua 5.4 interpreter on
the sample resources in fixtures/argocd_health_cases.yaml."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from monitoring_helpers import ARGOCD, ARGOCD_CM, FIXTURES, LUA_HEALTH, lua_literal, plain_json

CASES = yaml.safe_load((FIXTURES / "argocd_health_cases.yaml").read_text())
KEY = "resource.customizations.health.shoal.dev_InferenceDeployment"

# Argo CD gives the object as the global `obj`, and runs the script as a chunk whose
# return value is the health table. This harness does the same.
HARNESS = """\
obj = {literal}
local chunk = assert(loadfile({script}))
local hs = chunk()
assert(type(hs) == "table", "the script must return a table")
assert(type(hs.status) == "string", "hs.status must be a string")
io.write(hs.status, "\\n", tostring(hs.message or ""), "\\n")
"""


def run_health(lua: str, obj: dict, tmp_path) -> tuple[str, str]:
    harness = tmp_path / "harness.lua"
    harness.write_text(HARNESS.format(literal=lua_literal(plain_json(obj)),
                                      script=lua_literal(str(LUA_HEALTH))))
    out = subprocess.run([lua, str(harness)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    status, message = out.stdout.split("\n", 1)
    return status, message.rstrip("\n")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_health(case, lua, tmp_path):
    status, message = run_health(lua, case["object"], tmp_path)
    assert status == case["expect"]["status"], message
    assert case["expect"].get("message", "") in message
    assert message, "Argo CD shows the message: it should never be empty"


def test_the_four_verdicts_are_covered():
    assert {c["expect"]["status"] for c in CASES} == {"Healthy", "Progressing", "Degraded", "Suspended"}


def test_argocd_cm_carries_the_lua_file():
    out = subprocess.run([sys.executable, str(ARGOCD / "gen_argocd_cm.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cm = yaml.safe_load(ARGOCD_CM.read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    assert cm["data"][KEY] == LUA_HEALTH.read_text()


def test_script_stays_inside_argocds_sandbox():
    # Argo CD opens only the base, table, string and math libraries (gopher-lua 5.1):
    # no io/os/require, no 5.3+ integer division or bit operators, no goto.
    code = re.sub(r"--[^\n]*", "", LUA_HEALTH.read_text())
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)
    for word in ("io.", "os.", "require", "dofile", "loadfile", "load(", "debug.", "utf8.", "goto", "//", "<<", ">>"):
        assert word not in code, f"{word!r} is not available to Argo CD health scripts"
