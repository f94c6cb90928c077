"""qcheck's invariant suite, as pytest modules; the plugin collects them wherever recipes are selected."""
