"""The project's tests (a package, so that tests.gated_norm_inputs imports the same way
everywhere)."""
