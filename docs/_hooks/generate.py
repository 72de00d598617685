"""MkDocs hook: fill the generated parts of the reference pages (filled in later)."""
