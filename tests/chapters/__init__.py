"""The chapters as files: commands, terms, static checks; exercises/ for checkers."""
