# The version of the package and of the writer that a manifest names (`writer_version`).
# Bumped whenever the checkpoint format or the public API changes; CHANGELOG.md has a
# section for every version (tests/test_changelog.py holds the two together).
__version__ = "0.4.8"
