"""The benchmarks: one script per measurement, each run from the repository root as
`python -m benchmarks.NAME` (docs/benchmarks.md lists them). What several scripts share, and the
parts of a script run by no one alone, is `benchmarks.common`; a script imports it, and any other
script it builds on, by its full name: no script edits the import path."""
