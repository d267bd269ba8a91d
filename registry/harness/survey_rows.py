"""The survey's record: one op_db entry under one stack, batching variant and dtype."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class SurveyRow:
    """One op_db entry under one stack, batching variant and dtype: native's worst status over the samples, and the
    worst status inside ``registry.use()``."""

    op: str  # the op_db entry: its name, ".variant" appended when the entry has a variant_test_name
    opinfo_name: str
    variant_test_name: str
    stack: str
    batching: str
    dtype: str
    native_status: str
    native_detail: str
    use_status: str
    use_detail: str
    max_abs_error: float | None
    max_rel_error: float | None
    samples: int
    torch_version: str
    timestamp: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

