"""Out-of-tree dataset-format plugins used by the tests (loaded with `data.plugins`)."""
