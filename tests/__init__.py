"""The suite: unit/ (dmlbook's modules), chapters/ (the notebooks, their exercises),
system/ (whole-system runs); support/ holds helpers (docs/guides/testing.md)."""
