"""Bundled data: sample workspace and demo scenario."""
