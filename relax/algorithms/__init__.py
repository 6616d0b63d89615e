"""Training algorithms, one package each, on the shared core of ``relax.train``."""
