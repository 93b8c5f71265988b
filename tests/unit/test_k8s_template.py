"""deploy/k8s/base-job-template.json: a Prefect work pool job template for rollout workers on Kubernetes.

No cluster runs here: these check what can be checked without one - the template is what Prefect's
server accepts (test_work_pool.py creates a kubernetes pool with it on a real server), its variables
are a valid JSON schema whose defaults satisfy it, every placeholder names a variable, and the pod
carries the ledger secret and a Docker-in-Docker sidecar that ends with the worker.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base-job-template.json"


def _template() -> dict:
    return json.loads(TEMPLATE.read_text())


def test_variables_are_a_json_schema_and_their_defaults_satisfy_it():
    variables = _template()["variables"]
    jsonschema.Draft7Validator.check_schema(variables)
    defaults = {name: spec["default"] for name, spec in variables["properties"].items() if "default" in spec}
    jsonschema.validate(defaults, variables)
    assert defaults["image"] == "loopline-rollout:latest" and defaults["env"]["DOCKER_HOST"] == "tcp://localhost:2375"


def test_every_placeholder_names_a_variable():
    template = _template()
    placeholders = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", json.dumps(template["job_configuration"])))
    assert placeholders and placeholders <= set(template["variables"]["properties"])


def test_the_pod_gets_the_ledger_and_a_docker_sidecar_that_ends_with_it():
    pod = _template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["envFrom"] == [{"secretRef": {"name": "{{ ledger_secret }}"}}]
    (dind,) = pod["initContainers"]
    assert dind["restartPolicy"] == "Always" and dind["securityContext"]["privileged"]  # a native sidecar: the Job completes
    assert pod["restartPolicy"] == "Never"
