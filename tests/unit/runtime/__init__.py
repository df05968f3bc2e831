"""Tests of dmlbook.runtime and its face, dmlbook.launch."""
