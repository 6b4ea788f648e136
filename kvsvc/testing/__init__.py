"""Test harness for people who embed kvsvc (and for kvsvc's own tests): fixtures, a fake clock, peer pairs."""

from __future__ import annotations
