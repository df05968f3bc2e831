"""Sphinx's configuration of the book's site (``make site``; dmlbook/book/static_site.py builds it).

Sphinx with myst-nb (the notebooks and Markdown pages) and sphinx-book-theme: the stack behind
Jupyter Book 1, which builds with no network (Jupyter Book 2 fetches its theme at build time).
The chapters arrive executed (dmlbook/book/executed.py), so nothing runs here.
"""

from __future__ import annotations

project = "dmlbook"
author = "the dmlbook authors"
copyright = "2026, the dmlbook authors"
html_title = "Distributed Machine Learning with Python: the workbook"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# Nothing runs at build time: the chapters come with their outputs.
nb_execution_mode = "off"
# A notebook's stream output is shown whole, not scrolled in a small box.
nb_merge_streams = True
# Widgets need a live kernel (and a script from the internet): never on a page.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

# A heading's anchor is the one JupyterLab gives it (its text, each space made "-"), so that a
# chapter's link to a section, or to a glossary term (glossary.ipynb#all-reduce), works in
# JupyterLab and on the site alike.
myst_heading_anchors = 4
myst_heading_slug_func = "dmlbook.book.static_site.heading_id"
myst_enable_extensions = ["colon_fence"]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings: list[str] = []

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
# A ring of three ranks; without one the browser asks for /favicon.ico and logs its 404.
html_favicon = "_static/favicon.svg"
html_theme_options = {
    "repository_url": "",
    "use_download_button": True,
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "home_page_in_toc": True,
}
# The light or dark colours as the reader's system has them (the theme logs an error without it).
html_context = {"default_mode": "auto"}
html_last_updated_fmt = None
html_copy_source = True
html_show_sourcelink = False

# The API reference reads the docstrings; a package's face is documented where its names live.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_inherit_docstrings = False  # torch.autograd.Function's docstrings are torch's, not ours


def _skip_builtin_names(app, what, name, obj, skip, options):
    """A dataclass field named like a builtin (``TcpCount.bytes``) would become the target of
    every ``bytes`` annotation in the package; the class's docstring describes its fields."""
    import builtins

    return True if what == "class" and hasattr(builtins, name) else None


def setup(app):
    app.connect("autodoc-skip-member", _skip_builtin_names)
