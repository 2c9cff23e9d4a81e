"""Tools run as modules: `python -m v1.tools.gpu_check` and `v1.tools.wheels`."""
