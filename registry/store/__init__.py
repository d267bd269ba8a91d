"""Storage: the matrix and profile tables (SQLAlchemy) and the evidence the selector reads from them."""

# The survey's and the conformance suite's tables are defined on the same metadata; importing them here means every
# Store() creates them too.
from registry.store import conformance as _conformance  # noqa: F401
from registry.store import survey as _survey  # noqa: F401
