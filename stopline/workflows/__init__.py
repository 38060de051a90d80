"""Deterministic workflow code only: no I/O, no clocks but ``workflow.now()``.

A test (``tests/test_workflow_determinism.py``) scans this package for
forbidden imports and calls.
"""
