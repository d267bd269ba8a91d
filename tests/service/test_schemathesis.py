"""schemathesis against /openapi.json: a bounded number of generated requests per operation, no 5xx, and every
response conforms to the schema. POST and DELETE run behind a token here, so no generated job actually starts."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from service.main import create_app
from service.settings import Settings

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(Settings(token="not-given")))


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case) -> None:
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])
