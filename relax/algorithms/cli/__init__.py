"""Command lines and run configuration: flags, nested configs, the start-up report."""
