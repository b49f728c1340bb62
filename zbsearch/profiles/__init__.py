"""Bundled profiles: the paper's models and small measured ones, shipped as package data."""
