"""Development tools run from the repository root (`python -m tools.X` or `python tools/X.py`);
not part of the installed packages."""
