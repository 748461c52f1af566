"""Helpers shared by tests: in-process fakes and drivers."""
