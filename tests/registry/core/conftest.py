"""The routing tests run on both backends: ``pytestmark = pytest.mark.usefixtures("routing_backend")``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType
from typing import NoReturn

import pytest

from registry.core import kernels, routing


@pytest.fixture(scope="module", params=["cpp", "python"])
def routing_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each module's tests once with the C++ kernels and once with the Python ones (module scope: one switch per
    module and backend). Without a compiler the C++ run skips, saying how to get one; under ``make test`` as root
    (ROUTING_TEST_REQUIRE_CPP=1, after the Makefile installed the headers) it fails instead."""
    backend = request.param
    try:
        routing.set_routing_backend(backend)
    except kernels.KernelBuildError as error:
        _without_kernels(error)
    yield backend


@pytest.fixture
def compiled_kernels() -> ModuleType:
    """The compiled kernels' module, loaded (built first where the cache has none); skips or fails as
    ``routing_backend`` does where they cannot be built."""
    try:
        module = kernels.load()
    except kernels.KernelBuildError as error:
        _without_kernels(error)
    assert module is not None  # load() waits for the build
    return module


def _without_kernels(error: kernels.KernelBuildError) -> NoReturn:
    if os.environ.get("ROUTING_TEST_REQUIRE_CPP") == "1":
        pytest.fail(f"the C++ routing kernels cannot be built: {error}", pytrace=False)
    pytest.skip(f"C++ routing kernels unavailable: {error}")
