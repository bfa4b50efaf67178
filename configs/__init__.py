"""The recipes: YAML presets run by name (`rlcore run <name>`) and the published HF model configs they are sized with
(models/*.json). This folder installs as the package ``rlcore.presets`` (see setup.py), so an editable checkout and a
wheel find the same files; it holds each recipe once."""
