"""Storage: the matrix and profile tables (SQLAlchemy) and the evidence the selector reads from them."""
