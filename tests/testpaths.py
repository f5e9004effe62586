"""Paths shared by the tests (import this, never conftest: several conftest modules exist)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
