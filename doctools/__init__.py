"""Build-time tools of the documentation site (mkdocs.yml's hooks, generated references, zh notebooks)."""
