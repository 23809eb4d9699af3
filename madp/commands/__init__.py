"""The `madp` commands, one module per family (data, bounding, batching, accounting, training, report),
each adding its subcommands' arguments and naming their handlers in a `registry.Family`; the CLI and
`madp run` build their parser from the same families."""
