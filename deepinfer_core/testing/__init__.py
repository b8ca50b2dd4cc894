"""Test support: op conformance cases (``conformance``) and tolerance-aware comparison (``compare``).

Import the submodules explicitly; nothing heavy is imported here.
"""
