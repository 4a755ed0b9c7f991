"""Schemathesis fuzzes every operation of the OpenAPI document: bad input is a 4xx, never a 500 or a hang.

Bounded: a few examples per operation (about a minute on 2 shared cores).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from .server_fixtures import KEYS, ServerProcess

#: per operation and per mode (valid and invalid input)
EXAMPLES_PER_OPERATION = 8


class Live:
    """The fuzzing server plus one real sandbox, so sandbox routes are reached, not just 404s."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.http = server.client("alice")
        self.sandbox_id = ""

    def sandbox(self) -> str:
        if not self.sandbox_id or self.http.get(f"/v1/sandboxes/{self.sandbox_id}").status_code != 200:
            created = self.http.post("/v1/sandboxes", json={"limits": {"memory": "64M", "timeout": 3}})
            assert created.status_code == 201, created.text
            self.sandbox_id = created.json()["id"]
        return self.sandbox_id


@pytest.fixture(scope="module")
def live(state_dir: Path) -> Iterator[Live]:
    config = {"max_request_bytes": 256 << 10, "max_sandboxes_per_tenant": 4, "max_memory_per_tenant": "1G"}
    with ServerProcess(state_dir / "srv-fuzz", keys=KEYS, config=config) as server:
        yield Live(server)


def test_no_server_errors(live: Live) -> None:
    # driven by hand rather than schemathesis' pytest plugin (which does not load under this pytest)
    schema = schemathesis.openapi.from_url(live.server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            check_case(case, live)

        try:
            call()
        except Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # nothing can be invalid about e.g. GET /healthz


def check_case(case: Any, live: Live) -> None:
    destroys_it = case.method == "DELETE" and case.path == "/v1/sandboxes/{sandbox_id}"
    if case.path_parameters and "sandbox_id" in case.path_parameters and not destroys_it:
        case.path_parameters["sandbox_id"] = live.sandbox()
    if isinstance(case.body, dict) and isinstance(case.body.get("timeout"), (int, float)):
        case.body["timeout"] = min(case.body["timeout"], 3)  # keep any one command short
    response = case.call(headers=live.server.headers("alice"), timeout=30)
    # the port proxy's 502 is its answer for a port nothing listens on (the fuzzed sandboxes listen on none)
    bad_gateway = case.path.startswith("/v1/sandboxes/{sandbox_id}/ports/") and response.status_code == 502
    assert response.status_code < 500 or bad_gateway, \
        f"{case.method} {case.path}: {response.status_code} {response.text[:500]}\n" \
        f"body: {case.body!r}\nserver log (end):\n{live.server.log()[-3000:]}"
    if case.method == "POST" and case.path == "/v1/sandboxes" and response.status_code == 201:
        httpx.delete(live.server.url + f"/v1/sandboxes/{response.json()['id']}", headers=live.server.headers("alice"))
