"""Tests that kill surviving mutants of `make mutate` (issue 20), area: ops.

Each test pins a behaviour users rely on, with values chosen so that a wrong implementation is off clearly;
docs/testing.md explains the loop (run mutants, read survivors, add a test or list an equivalent).
"""
