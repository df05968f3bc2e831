"""Tests of dmlbook.classroom."""
