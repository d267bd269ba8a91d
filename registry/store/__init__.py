"""Storage: the matrix and profile tables (SQLAlchemy) and the evidence the selector reads from them."""

# The survey's table is defined on the same metadata; importing it here means every Store() creates it too.
from registry.store import survey as _survey  # noqa: F401
