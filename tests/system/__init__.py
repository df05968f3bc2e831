"""Whole-system runs: installs, the hub, a browser, concurrency, load, the site."""
