"""The store's schema migrations (Alembic): ``env.py``, and one revision per schema change under ``versions/``.

They run through ``registry.store.migrate`` (``multicomposite db upgrade``); there is no alembic.ini. A new revision,
after changing the tables (``registry/store/evidence_store.py``, ``job_store.py``, ``survey.py``, ...)::

    python -c "from alembic import command; from registry.store.migrate import _config; \\
               command.revision(_config(), message='what changes', rev_id='0003')"

then write its ``upgrade()`` and ``downgrade()`` for SQLite and PostgreSQL, and extend tests/registry/store/
test_migrations.py (``test_a_fresh_store_has_exactly_the_schema_of_the_models`` fails until they agree).
"""
