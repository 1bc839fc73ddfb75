"""The `wise` application: the command line over every package of the project (`wise.cli`).
Nothing in the project imports it; it imports the libraries below it (wise_core, wise_torch,
wise_jax, wise_serve, parity) only when a command runs."""
