"""The application layer: the CLI, the HTTP service, benchmarks, exports, plots and importers."""
