"""The mapped classes made from the records: their columns are the records' fields, in order, typed as ``stored``
says, and a field the declarative layer cannot map is refused with its name."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import BigInteger, Float, Integer, String, Text, create_engine, insert, select

from registry.store.evidence_store import BenchRunRow, MatrixRow, ProfileRow
from registry.store.job_store import JobRow
from registry.store.records import BenchRun, JobRecord, MatrixEntry, ProfileEntry, stored
from registry.store.tables import JSONText, mapped_record


def test_a_mapped_class_has_one_column_per_field_after_its_own_id() -> None:
    for row, record in ((MatrixRow, MatrixEntry), (ProfileRow, ProfileEntry)):
        names = [column.name for column in row.__table__.columns]
        assert names == ["id", *(spec.name for spec in dataclasses.fields(record))]
    for row, record in ((JobRow, JobRecord), (BenchRunRow, BenchRun)):  # the record's own key, no extra id
        assert [column.name for column in row.__table__.primary_key] == ["id"]
        assert [column.name for column in row.__table__.columns] == [spec.name for spec in dataclasses.fields(record)]
    assert BenchRunRow.__table__.c.id.autoincrement is True  # numbered by the database
    assert JobRow.__table__.c.id.autoincrement == "auto"  # a string key: the job's own id


def test_column_types_follow_the_declaration() -> None:
    columns = ProfileRow.__table__.c
    assert isinstance(columns.op.type, String) and columns.op.type.length == 200 and columns.op.index
    assert isinstance(columns.stack.type, String) and columns.stack.type.length == 400  # a stack as its spelling
    assert isinstance(columns.detail.type, Text) and not columns.detail.nullable
    assert isinstance(columns.numel_bucket.type, BigInteger)  # wide
    assert isinstance(columns.batch_size.type, Integer) and not isinstance(columns.batch_size.type, BigInteger)
    assert isinstance(columns.median_us.type, Float) and columns.median_us.nullable
    assert isinstance(JobRow.__table__.c.params.type, JSONText) and not JobRow.__table__.c.params.nullable
    assert [c.name for c in ProfileRow.__table__.constraints if c.name == "uq_profile_key"] == ["uq_profile_key"]


def test_a_json_field_is_stored_as_text_and_read_back_as_the_dict() -> None:
    engine = create_engine("sqlite://")
    JobRow.__table__.create(engine)
    params = {"ops": ["add"], "stacks": ["vmap(grad)"], "sizes": [1, 2]}
    with engine.begin() as conn:
        conn.execute(insert(JobRow), [vars(JobRecord(id="j", kind="verify", params=params))])
        raw = conn.exec_driver_sql("SELECT params, result FROM jobs").one()
        read = conn.execute(select(JobRow.params, JobRow.result)).one()
    assert raw == ('{"ops": ["add"], "stacks": ["vmap(grad)"], "sizes": [1, 2]}', None)
    assert read == (params, None)


def _record(**fields: Any) -> type:
    return dataclasses.make_dataclass("Odd", [(name, hint, stored()) for name, hint in fields.items()], frozen=True)


@pytest.mark.parametrize(("fields", "message"), [
    ({"metadata": str}, "Odd.metadata"),  # the declarative class's own attribute
    ({"id": int}, "Odd.id"),  # the table's own id, without primary=True
    ({"sizes": list}, "Odd.sizes: no column type"),
])
def test_a_field_the_layer_cannot_map_is_refused_by_name(fields: dict[str, type], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        mapped_record(_record(**fields), "odd")
