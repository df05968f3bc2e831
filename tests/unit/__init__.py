"""Unit tests of dmlbook's modules, one folder per package."""
