"""Loopback helpers for tests that start real servers (the package's launcher has them: inferd/procs.py)."""

from __future__ import annotations

from inferd.procs import free_port

__all__ = ["free_port"]
