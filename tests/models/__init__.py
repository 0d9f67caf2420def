"""Helper models for CLI tests (importable as --model-factory tests.models.broken:NAME)."""
