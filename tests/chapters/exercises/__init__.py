"""Each chapter's exercise checkers (dmlbook.exercises), and back doors."""
