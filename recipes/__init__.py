"""Training recipes that produce files the library's policies load (``python -m recipes.<name>.train``)."""
