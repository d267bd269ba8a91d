"""Storage: the matrix, profile and survey tables (SQLAlchemy), their migrations, and the evidence source the selector
reads them through. Importing this package imports no SQLAlchemy: ``registry.store.evidence`` and
``registry.store.connection`` load it only when a store is opened.
"""
