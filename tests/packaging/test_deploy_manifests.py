"""deploy/'s Kubernetes manifests, offline: every built-in kind (and the pod templates of a
LeaderWorkerSet) validates against Kubernetes' own schemas (kubernetes-validate, strict);
every jetserve command in them parses with `jetserve serve`'s own arguments; every HTTP
probe names a route the server has; the InferencePool selects the serving pods."""

import glob
import os
import shlex

import kubernetes_validate
import pytest
import yaml

from jetserve.cli import build_parser

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "deploy")
K8S_VERSION = "1.33"
BUILT_IN = {"v1", "apps/v1", "batch/v1"}


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    template = doc.get("spec", {}).get("template")
    return [template] if template else []


def _jetserve_argv(container: dict) -> list[str]:
    cmd = container["command"]
    if cmd[:2] == ["sh", "-c"]:  # the pod's address through the environment
        cmd = shlex.split(cmd[2].replace('"$POD_IP"', "10.0.0.1").removeprefix("exec "))
    assert cmd[0] == "jetserve", cmd
    return cmd[1:]


DOCS = _docs()


def test_there_are_manifests_for_each_deployment():
    kinds = {d["kind"] for _, d in DOCS}
    assert {"LeaderWorkerSet", "StatefulSet", "Deployment", "Service",
            "InferencePool"} <= kinds


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_built_in_kinds_and_pod_templates_validate(name, doc):
    if doc["apiVersion"] in BUILT_IN:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if doc["kind"] == "LeaderWorkerSet":
        for template in _pod_specs(doc):
            pod = {"apiVersion": "v1", "kind": "Pod", **template}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_commands_parse_and_probes_name_real_routes(tiny_servers_routes):
    parser = build_parser("serve")
    seen = 0
    for _, doc in DOCS:
        for template in _pod_specs(doc):
            for c in template["spec"]["containers"]:
                parser.parse_args(_jetserve_argv(c))  # SystemExit on an unknown flag
                seen += 1
                for probe in ("readinessProbe", "livenessProbe"):
                    get = c.get(probe, {}).get("httpGet")
                    if get:
                        assert get["path"] in tiny_servers_routes, (probe, get)
    assert seen == 4


def test_the_inference_pool_selects_the_serving_pods():
    """The leaders and decode pods serve HTTP; LWS workers and prefill workers do not."""
    (pool,) = [d for _, d in DOCS if d["kind"] == "InferencePool"]
    want = pool["spec"]["selector"]["matchLabels"].items()
    parser = build_parser("serve")
    selected = {True: 0, False: 0}
    for _, doc in DOCS:
        for i, t in enumerate(_pod_specs(doc)):
            args = parser.parse_args(_jetserve_argv(t["spec"]["containers"][0]))
            is_lws_worker = doc["kind"] == "LeaderWorkerSet" and i == 1
            serves = args.role != "prefill" and not is_lws_worker
            assert (want <= t["metadata"]["labels"].items()) == serves, t["metadata"]
            selected[serves] += 1
    assert selected == {True: 2, False: 2}


@pytest.fixture(scope="module")
def tiny_servers_routes() -> set[str]:
    """The GET routes of the HTTP app (no model needed to list them)."""
    from fastapi import FastAPI

    from jetserve.server import probes

    app = FastAPI()
    probes.add_routes(app, lambda: None, None)
    return {r.path for r in app.routes} | {"/health", "/metrics"}
