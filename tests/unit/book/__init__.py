"""Tests of dmlbook.book."""
