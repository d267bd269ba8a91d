"""The HTTP face of multicomposite: a FastAPI app over ``registry`` and the ``multicomposite`` command line."""
