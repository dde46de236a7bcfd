"""The API against its own OpenAPI schema (schemathesis): generated requests, valid and invalid,
never get a 5xx, and every status, content type and body the server answers is one the schema
documents. A live server on loopback with fake models, so no tensor work runs; a few examples per
operation from a fixed seed, so a run takes seconds and repeats itself."""

from __future__ import annotations

import re

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from megaslide.server import Settings, build_app
from megaslide.server.worker import Fleet

from server_fakes import FakeBackend, live_server

EXAMPLES = 12  # per operation, valid and invalid requests together
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def api(tmp_path, database_url):
    """The schema as the live server serves it, loaded from there (so requests go to it), on
    SQLite and on PostgreSQL (whose text cannot hold the NUL characters generated strings carry)."""
    # Short waits: a generated DELETE of a running video must not hold the run for seconds.
    options = dict(
        data_dir=tmp_path / "data", database=database_url, cancel_wait_s=0.2, sse_interval_s=0.01
    )
    server_settings = Settings(**options, max_queue=1000)
    app = build_app(server_settings, Fleet.embedded(server_settings, FakeBackend(step_s=0.0)))
    with live_server(app, server_settings) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def test_the_api_keeps_to_its_schema(api):
    failures = {}
    for result in api.get_all_operations():
        operation = result.ok()

        @seed(20261203)
        @settings(
            max_examples=EXAMPLES,
            phases=[Phase.explicit, Phase.generate],  # a failure is reported as found, not shrunk
            deadline=None,
            database=None,  # nothing written to .hypothesis/
            suppress_health_check=list(HealthCheck),
        )
        # Generated strings include NUL characters (schemathesis' default `allow_x00`).
        @given(case=st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode)))
        def keeps_to_schema(case):
            case.call_and_validate(checks=CHECKS, timeout=10)

        try:
            keeps_to_schema()
        except Exception as e:  # every operation is tried; all failures are reported together
            failures[operation.label] = e
    assert not failures, "\n\n".join(f"{label}:\n{e}" for label, e in failures.items())


def test_the_schema_is_as_strict_as_the_server(make_client):
    """What the server refuses, its schema says: a prompt with some text, the hyperparameters'
    ranges, the upload form's field count, the bearer scheme; a 405 names every method."""
    c = make_client()
    schema = c.get("/openapi.json").json()
    create = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    prompt = create["application/json"]["schema"]["properties"]["prompt"]
    assert prompt["minLength"] == 1 and prompt["pattern"] == r"\S"
    assert c.post("/v1/videos", json={"prompt": "  "}).status_code == 400
    hyper = schema["components"]["schemas"]["Hyperparameters"]["properties"]
    assert hyper["n_epochs"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 100}
    assert hyper["learning_rate_multiplier"]["anyOf"][0]["exclusiveMinimum"] == 0
    job = {"model": "tiny", "training_file": "file-1", "hyperparameters": {"n_epochs": 101}}
    assert c.post("/v1/fine_tuning/jobs", json=job).status_code == 400
    form = schema["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["maxProperties"] == 8
    fields = {f"f{i}": "x" for i in range(8)}
    too_many = c.post("/v1/files", data={"purpose": "fine-tune", **fields}, files={"file": b"x"})
    assert too_many.status_code == 400
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/videos"]["get"]["security"] == [{"HTTPBearer": []}]
    for method, path, allowed in [
        ("PUT", "/v1/videos/video_1", "DELETE, GET"),
        ("PUT", "/v1/videos", "GET, POST"),
        ("POST", "/v1/models/tiny", "GET"),
    ]:
        r = c.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)


def test_every_reference_in_the_schema_resolves(make_client):
    """Code generators follow each `$ref` from the document's root: none may point nowhere."""
    schema = make_client().get("/openapi.json").json()
    refs = []

    def walk(node, where):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append((where, node["$ref"]))
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(schema, "")
    assert refs, "the document refers to its components"
    unresolved = []
    for where, ref in refs:
        target = schema if ref.startswith("#/") else None
        for part in ref.removeprefix("#/").split("/") if target is not None else ():
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            unresolved.append(f"{where}: {ref}")
    assert not unresolved, "\n".join(unresolved)


def test_the_refusal_any_request_can_meet_is_documented(make_client):
    """A NUL in a request's query or path is refused 400 before any route runs: every operation
    documents that answer."""
    c = make_client()
    schema = c.get("/openapi.json").json()
    for template, operations in schema["paths"].items():
        for method, operation in operations.items():
            urls = [(re.sub(r"\{[^}]+\}", "x", template), {"q": "\x00"})]
            if "{" in template:
                urls.append((re.sub(r"\{[^}]+\}", "x%00", template), {}))
            for url, params in urls:
                r = c.request(method.upper(), url, params=params)
                assert r.status_code == 400, (method, url, r.text)
                assert "400" in operation["responses"], (method, template)
