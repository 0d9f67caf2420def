"""Models that break in the ways a batch must survive (used by tests/test_batch_*.py as model factories)."""
