"""The CLI's copies of the registry's vocabularies (service/cli/vocabulary.py, kept so that --help loads no torch)
equal their sources."""

from __future__ import annotations

from registry.core.selector import POLICIES
from registry.core.status import STATUSES
from registry.store.job_store import JOB_STATES
from service.cli import vocabulary


def test_the_clis_choices_are_the_registrys() -> None:
    assert vocabulary.POLICIES == POLICIES
    assert vocabulary.STATUSES == STATUSES
    assert vocabulary.JOB_STATES == JOB_STATES
