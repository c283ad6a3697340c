"""The glue of the flow: the run config, the table of stages and the runner that knows none of
them by name. Libraries never import this package."""
