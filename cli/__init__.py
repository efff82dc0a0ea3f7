"""The `cellserve` command: serve (server/), chat and bench (clients), build-kernels."""
